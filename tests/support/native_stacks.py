"""Native (C and C++) stacks of hung processes, for a test's hang report.

``faulthandler`` shows Python frames only: a thread stuck inside a C call (``os.fork()``, a lock
of a library, a syscall) shows as the Python line that made the call. When ``gdb`` is on PATH,
this attaches to each process for a moment (ptrace stops it while the backtraces are read),
prints every thread's backtrace and detaches. It runs only once a test has already failed on a
hang, and it ends no process.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

FRAMES = 24  # innermost frames per thread
BUDGET_S = 30  # all of one report: it comes late in a test that pytest-timeout ends at 180 s
MAX_PROCESSES = 8


def children(pid: int) -> list[int]:
    """The processes that ``pid``'s threads forked (DataLoader workers, for a worker)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in task.read_text().split()]
        except OSError:  # the thread or the process ended meanwhile
            continue
    return sorted(found)


def native_stacks(pids: Iterable[int]) -> str:
    """Every thread's native backtrace of each of ``pids`` and of their children (at most
    ``MAX_PROCESSES``, within ``BUDGET_S`` in all), or one line saying why there are none."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb on PATH: no native stacks)"
    targets = [p for pid in pids for p in (pid, *children(pid))][:MAX_PROCESSES]
    deadline = time.monotonic() + BUDGET_S
    parts = []
    for pid in targets:
        left = deadline - time.monotonic()
        if left <= 0:
            parts.append(f"--- process {pid}: not read, the {BUDGET_S} s for native stacks "
                         "were spent ---")
            continue
        try:
            ran = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx",
                                  "-ex", f"thread apply all bt {FRAMES}"],
                                 capture_output=True, text=True, timeout=left, check=False)
            lines = [line for line in ran.stdout.splitlines()
                     if line.startswith(("#", "Thread "))]
            text = "\n".join(lines) or f"(gdb printed no stack: {ran.stderr.strip()[-300:]})"
        except subprocess.TimeoutExpired:
            text = "(gdb did not finish within the time left for native stacks)"
        except OSError as exc:
            text = f"(gdb could not run: {exc})"
        parts.append(f"--- native stacks of process {pid} ---\n{text}")
    return "\n".join(parts)
