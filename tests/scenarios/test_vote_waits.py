"""A rank votes at ``commit_step()`` only once its step's collectives completed (issue 39).

Real etcd, three real workers, gloo on loopback, float64, each rank its own inputs. Their DDP
communication hook returns at once and reduces each bucket afterwards on a helper thread, as
NCCL's enqueued all-reduce does (``tests/workers/async_hook.py``). Worker 2's last bucket of
step 4 is slow, and worker 2 is SIGKILLed inside that step's ``commit_step()`` block, after its
vote. A vote that waits for the tracked reductions is taken only once they completed
everywhere: the survivors apply the same, whole step and end equal. Without the wait (the
hook's futures untracked), every rank votes yes with the last bucket in flight, the survivors
apply their own un-reduced gradients, record the same version, and nothing at the
re-formation tells them apart: they end with different parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)
SCRIPT = Path(__file__).parents[1] / "workers" / "async_hook.py"
STEPS = 10


def _run(make_job, extra: list[str]):
    job = make_job(["--steps", str(STEPS), "--kill-step", "4", "--victim", "2", *extra],
                   script=SCRIPT)
    job.start_together(range(3))
    exits = [job.wait_exit(index, timeout=180) for index in (0, 1)]
    assert job.fired("kill", 2)["step"] == 4
    results = [job.result(index) for index in (0, 1)]
    assert [r["step"] for r in results] == [STEPS, STEPS]
    difference = max(abs(a - b) for p, q in zip(results[0]["params"], results[1]["params"])
                     for a, b in zip(p, q))
    return difference, exits, job


def test_survivors_end_equal_when_a_peer_dies_after_its_vote_with_a_reduction_in_flight(make_job):
    difference, exits, job = _run(make_job, [])
    assert difference == 0.0
    assert exits == [0, 0], job.tails()


def test_survivors_diverge_when_the_vote_does_not_wait_for_the_hook_reductions(make_job):
    # The scenario bites: with nothing to wait for, the same kill leaves the survivors apart.
    difference, exits, job = _run(make_job, ["--untracked"])
    assert difference > 1e-6
    assert exits == [0, 0], job.tails()
