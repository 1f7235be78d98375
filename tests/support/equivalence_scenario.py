"""The issue-5 scenario of tests/scenarios/test_equivalence.py and benchmarks/plot_equivalence.py.

An uninterrupted world-2 job and an elastic job that goes 3 -> 2 (SIGKILL of worker 2 at step
10, survivors roll back to step 8) -> 3 (worker 3 joins; the group holds at step 16 until it is
in; it also holds at step 4 until a slow-starting worker 2 is in) -> 2 (SIGTERM of worker 3 at step 26, it leaves at the commit of step 28), both running
tests/workers/global_batch.py with the same seed and global batch. Waits are bounded.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any

from tests.support.harness import Job

SCRIPT = Path(__file__).resolve().parent.parent / "workers" / "global_batch.py"
ARGS = ["--epochs", "2", "--samples", "194", "--global-batch", "12", "--commit-every", "4"]
STEPS = 2 * 17  # 16 full global batches of 12 and a last one of 2, per epoch
ELASTIC_FAULTS = "kill:2:10,term:3:26"
HOLD = ["--hold-at", "4,16"]  # world 3 by step 4 (a slow starter) and again by step 16


def start_reference(job: Job) -> None:
    """Starts the uninterrupted world-2 job."""
    job.start_together([0, 1])


def finish_reference(job: Job) -> dict[str, Any]:
    """Waits for the world-2 job; returns worker 0's result."""
    for index in (0, 1):
        assert job.wait_exit(index) == 0, job.tails()
    return job.result(0)


def run_elastic(job: Job) -> list[dict[str, Any]]:
    """Drives 3 -> 2 (SIGKILL) -> 3 (join) -> 2 (SIGTERM); returns the survivors' results.

    The job must have been made with ``HOLD`` and ``FAULTS=ELASTIC_FAULTS``.
    """
    job.start_together(range(3))
    assert job.wait_exit(2) == -signal.SIGKILL, job.tails()
    job.wait_until(lambda: any(p.get("world") == 2 and "loss" in p for p in job.progress(0)),
                   60, "the survivors to train in world 2")
    job.start(3)
    assert job.wait_exit(3) == 0, job.tails()
    assert job.fired("term", 3)["world"] == 3
    for index in (0, 1):
        assert job.wait_exit(index) == 0, job.tails()
    return [job.result(0), job.result(1)]


def worlds(job: Job, index: int) -> list[int]:
    """World sizes of worker ``index``'s trained steps, with consecutive repeats merged."""
    seen: list[int] = []
    for entry in job.progress(index):
        if "loss" in entry and (not seen or seen[-1] != entry["world"]):
            seen.append(entry["world"])
    return seen


def max_difference(a: list[float], b: list[float]) -> float:
    """Largest absolute elementwise difference of two equally long lists; NaN if any is."""
    assert len(a) == len(b), (len(a), len(b))
    differences = [abs(x - y) for x, y in zip(a, b)]
    return math.nan if any(map(math.isnan, differences)) else max(differences)
