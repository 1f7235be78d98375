"""Issue 43: sharded (FSDP2 / HSDP) jobs lose and regain ranks and reshard N -> M in memory.

Real etcd, real worker processes (tests/workers/sharded.py), gloo on loopback, float64, AdamW.
Each elastic job ends with the parameters and the committed loss curve of an uninterrupted
world-1 run of the same script (<= 1e-12), every sample of every epoch in the committed ledger
exactly once, a ``resharded`` event per re-formation, and no process left.
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.support.equivalence_scenario import max_difference
from tests.workers import sharded

pytestmark = pytest.mark.timeout(360)  # generous: the machine the suite runs on is shared
SCRIPT = sharded.__file__
ARGS = ["--epochs", "2", "--samples", "96", "--global-batch", "8", "--commit-every", "4"]
STEPS = 2 * 12
TOLERANCE = 1e-12


def _reference(make_job):
    job = make_job(ARGS, script=SCRIPT)
    job.start(0)
    return job


def _check(job, reference, survivors: list[int]) -> None:
    assert reference.wait_exit(0) == 0, reference.tails()
    want = reference.result(0)
    assert len(want["history"]) == STEPS
    for index in survivors:
        assert job.wait_exit(index) == 0, job.tails()
        got = job.result(index)
        assert got["step"] == STEPS
        assert max_difference(got["params"], want["params"]) <= TOLERANCE
        assert max_difference(got["history"], want["history"]) <= TOLERANCE
        for epoch, seen in enumerate(got["ledger"]):
            assert sorted(Counter(seen).items()) == [(i, 1) for i in range(96)], epoch
    resharded = [e for e in job.events() if e["event"] == "resharded"]
    assert resharded and all(e["bytes_moved"] == e["bytes_minimum"] for e in resharded)


def _fired(job, index: int) -> bool:
    return (job.out / f"fired-kill-{index}").exists()


def _worlds(job, index: int) -> list[int]:
    seen: list[int] = []
    for entry in job.progress(index):
        if "loss" in entry and (not seen or seen[-1] != entry["world"]):
            seen.append(entry["world"])
    return seen


def _kill_then_join(make_job, extra: list[str], fault: str, rollback: bool = True) -> None:
    """4 workers; the rank named by ``fault`` dies after step 10; the survivors carry on at 3
    (after redoing steps 9 and 10 from the commit of step 8 when ``rollback``) and hold at
    step 16 until a fifth worker joins them back to 4."""
    reference = _reference(make_job)
    job = make_job(ARGS + extra + ["--hold-at", "16:4"], {"FAULT": fault}, script=SCRIPT)
    job.start_together(range(4))
    job.wait_until(lambda: any(_fired(job, i) for i in range(4)), 150, "the kill")
    killed = [i for i in range(4) if _fired(job, i)]
    assert job.wait_exit(killed[0]) == -signal.SIGKILL
    survivors = [i for i in range(4) if i not in killed]
    job.wait_until(lambda: 3 in _worlds(job, survivors[0]), 150, "training at world 3")
    job.start(4)
    _check(job, reference, survivors + [4])
    assert _worlds(job, survivors[0]) == [4, 3, 4]
    steps = [p["step"] for p in job.progress(survivors[0]) if "loss" in p]
    assert steps.count(10) == (2 if rollback else 1), steps
    moves = {(e["from_world"], e["to_world"]) for e in job.events() if e["event"] == "resharded"}
    assert {(4, 3), (3, 4)} <= moves, moves


def test_fsdp_four_to_three_by_a_kill_and_back_to_four_by_a_join_keeps_the_math(make_job):
    _kill_then_join(make_job, [], "kill:2:10:4")


def test_hsdp_two_by_two_losing_a_rank_trains_on_as_fsdp_over_three_and_regains_it(make_job):
    _kill_then_join(make_job, ["--shard-degree", "2"], "kill:3:10:4")


def test_hsdp_with_copy_free_commits_loses_a_rank_without_a_rollback_and_regains_it(make_job):
    _kill_then_join(make_job, ["--shard-degree", "2", "--copy-free"], "kill:0:10:4",
                    rollback=False)


def test_fsdp_four_to_two_by_two_kills_that_leave_a_holder_of_every_shard(make_job):
    reference = _reference(make_job)
    job = make_job(ARGS, {"FAULT": "kill:1,3:10:4"}, script=SCRIPT)
    job.start_together(range(4))
    job.wait_until(lambda: sum(bool(_fired(job, i)) for i in range(4)) == 2, 150, "two kills")
    survivors = [i for i in range(4) if not _fired(job, i)]
    _check(job, reference, survivors)
    assert _worlds(job, survivors[0])[-1] == 2
