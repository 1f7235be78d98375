"""How a test worker stays busy for a while without being frozen: a pure-Python section, a
native op that releases the GIL, a full garbage collection of a big heap, and a CPU starved by a
busier sibling. Each reports what it did in ``busy-{index}.json``, so that a test can check that
it lasted long enough to mean something."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

# The sibling: pins itself and every thread of the worker to one CPU, runs at a higher priority
# (nice -15: the worker keeps about 3% of that CPU) for the given seconds, then gives the worker
# its CPUs back.
_SIBLING = """
import os, sys, time
worker, seconds, cpu, report = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
started = time.monotonic()
tasks = [int(t) for t in os.listdir(f"/proc/{worker}/task")]
before = {t: os.sched_getaffinity(t) for t in tasks}
os.sched_setaffinity(0, {cpu})
os.setpriority(os.PRIO_PROCESS, 0, -15)
for t in tasks:
    os.sched_setaffinity(t, {cpu})
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    pass
for t, mask in before.items():
    try:
        os.sched_setaffinity(t, mask)
    except ProcessLookupError:
        pass
open(report, "w").write(str(time.monotonic() - started))
"""


def busy(kind: str, out: Path, index: int, seconds: float) -> None:
    """Runs the busy section ``kind`` (``python``, ``native``, ``gc`` or ``starve``)."""
    started = time.monotonic()
    report: dict[str, object] = {"kind": kind}
    if kind == "python":
        while time.monotonic() - started < seconds:
            sum(range(1000))  # holds the GIL but for the interpreter's switch interval
    elif kind == "native":
        x = torch.full((2048, 2048), 0.01, dtype=torch.float32)
        while time.monotonic() - started < seconds:
            torch.mm(x, x)  # a long op that releases the GIL
    elif kind == "gc":  # a heap doubled until one full collection lasts half of ``seconds``
        gc.disable()
        heap: list[list[None]] = []
        while len(heap) < 32_000_000:  # about 2.7 GB at the most, on the fastest machine
            heap.extend([None] for _ in range(max(len(heap), 1_000_000)))
            collecting = time.monotonic()
            gc.collect()  # stops every thread of the process for its whole length
            report["collect_s"] = time.monotonic() - collecting
            if report["collect_s"] >= seconds / 2:
                break
        report["objects"] = len(heap)
        gc.enable()
        del heap  # freed in one call, holding the GIL too
    elif kind == "starve":
        cpu = min(os.sched_getaffinity(0))
        sibling = subprocess.Popen([sys.executable, "-c", _SIBLING, str(os.getpid()),
                                    str(seconds), str(cpu), str(out / f"starved-{index}")])
        report["sibling"] = sibling.pid  # the worker trains on, starved, meanwhile
    report["seconds"] = time.monotonic() - started
    (out / f"busy-{index}.json").write_text(json.dumps(report))
