"""Issue 17 item 1 end to end: copy-free commits (``commit_step`` every step) keep the math.

The scenario of test_equivalence.py (real etcd, real worker processes, gloo on loopback, float64,
constant global batch; 3 -> 2 by SIGKILL -> 3 by a join -> 2 by SIGTERM), with every step a
copy-free commit and no snapshot commit at all, and the SIGKILL fired before the step's
agreement (the step is skipped everywhere and trained again), inside the agreed block before
``optimizer.step()`` (the survivors applied it; the dead worker did not), or after the step. The
survivors end with the parameters and the loss curve of an uninterrupted world-2 job that takes
snapshot commits, and no agreed step is ever trained twice; also with dropout (seeded from the
committed RNG, drawn before the agreement) and DataLoader workers running random augmentation.
"""

from __future__ import annotations

import pytest

from tests.support.equivalence_scenario import (ARGS, HOLD, SCRIPT, STEPS, max_difference,
                                                run_elastic, worlds)

pytestmark = pytest.mark.timeout(150)
TOLERANCE = 1e-9


@pytest.mark.parametrize("where", ["before", "during", "after"])
def test_copy_free_commits_reach_the_parameters_of_an_uninterrupted_run_whatever_the_kill_hits(
        make_job, references, where):
    check_equivalent(make_job, references, where, [])


def test_dropout_and_dataloader_augmentation_replay_identically_with_copy_free_commits(
        make_job, references):
    check_equivalent(make_job, references, "before", ["--dropout", "0.2", "--loader-workers", "2"])


def check_equivalent(make_job, references, where: str, extra: list[str]) -> None:
    # The uninterrupted world-2 run (snapshot commits), beside the elastic job unless an
    # earlier test (here or in test_equivalence.py) ran it.
    reference_run = references.start(make_job, SCRIPT, ARGS + extra, world=2)
    elastic_job = make_job(ARGS + extra + HOLD + ["--copy-free"],
                           {"FAULTS": f"kill:2:10:{where},term:3:26"}, script=SCRIPT)
    survivors = run_elastic(elastic_job)
    reference = reference_run.result()
    assert elastic_job.fired("kill", 2)["where"] == where
    assert worlds(elastic_job, 0)[-4:] == [3, 2, 3, 2]
    trained = [p["step"] for p in elastic_job.progress(0) if "loss" in p]
    assert trained == list(range(1, STEPS + 1)), "an agreed step was lost or trained twice"
    for result in survivors:
        assert result["step"] == STEPS
        assert max_difference(result["params"], reference["params"]) < TOLERANCE
        assert max_difference(result["history"], reference["history"]) < TOLERANCE
