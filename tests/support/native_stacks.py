"""Native (C and C++) stacks of hung processes, for a test's hang report.

``faulthandler`` shows Python frames only: a thread stuck inside a C call (``os.fork()``, a lock
of a library, a syscall) shows as the Python line that made the call. When ``gdb`` is on PATH,
this attaches to each process for a moment (ptrace stops it while the backtraces are read),
prints every thread's backtrace and detaches. It runs only once a test has already failed on a
hang, and it ends no process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable

FRAMES = 24  # innermost frames per thread
ATTACH_S = 60  # one process's attach, backtraces and detach (torch's symbols take seconds)
MAX_PROCESSES = 8


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (DataLoader workers, for a worker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def native_stacks(pids: Iterable[int]) -> str:
    """Every thread's native backtrace of each of ``pids`` and of their children (at most
    ``MAX_PROCESSES`` in all), or one line saying why there are none."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb on PATH: no native stacks)"
    targets = [p for pid in pids for p in (pid, *children(pid))][:MAX_PROCESSES]
    parts = []
    for pid in targets:
        try:
            ran = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx",
                                  "-ex", f"thread apply all bt {FRAMES}"],
                                 capture_output=True, text=True, timeout=ATTACH_S, check=False)
            lines = [line for line in ran.stdout.splitlines()
                     if line.startswith(("#", "Thread "))]
            text = "\n".join(lines) or f"(gdb printed no stack: {ran.stderr.strip()[-300:]})"
        except subprocess.TimeoutExpired:
            text = f"(gdb did not finish within {ATTACH_S} s)"
        except OSError as exc:
            text = f"(gdb could not run: {exc})"
        parts.append(f"--- native stacks of process {pid} ---\n{text}")
    return "\n".join(parts)
