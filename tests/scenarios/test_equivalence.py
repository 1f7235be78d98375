"""Issue 5 end to end: elasticity does not change the math.

Real etcd, real worker processes, gloo on loopback, float64. With the same seed and global batch,
a job that goes 3 -> 2 (SIGKILL) -> 3 (join) -> 2 (SIGTERM) ends with the parameters of an
uninterrupted world-2 job and the same committed loss curve, step by step; also with dropout
(seeded per sample from the committed RNG) and DataLoader workers running random augmentation.
In per-worker-batch mode, LinearLRScaling sets the LR from the world size at every re-formation.
"""

from __future__ import annotations

import signal

import pytest

from tests.support.equivalence_scenario import (ARGS, ELASTIC_FAULTS, HOLD, SCRIPT, STEPS,
                                                max_difference, run_elastic, worlds)

pytestmark = pytest.mark.timeout(150)
TOLERANCE = 1e-9


def check_equivalent(make_job, references, extra: list[str]) -> None:
    # The uninterrupted world-2 run, beside the elastic job unless an earlier test ran it
    # (test_copy_free_equivalence.py compares with the same runs).
    reference_run = references.start(make_job, SCRIPT, ARGS + extra, world=2)
    elastic_job = make_job(ARGS + extra + HOLD, {"FAULTS": ELASTIC_FAULTS},
                           script=SCRIPT)
    survivors = run_elastic(elastic_job)
    reference = reference_run.result()
    assert worlds(elastic_job, 0)[-4:] == [3, 2, 3, 2]
    replayed = [p["step"] for p in elastic_job.progress(0) if "loss" in p]
    assert replayed.count(9) == 2, "the SIGKILL did not make the survivors roll back and redo"
    assert len(reference["history"]) == STEPS
    for result in survivors:
        assert result["step"] == STEPS
        assert max_difference(result["params"], reference["params"]) < TOLERANCE
        assert max_difference(result["history"], reference["history"]) < TOLERANCE


def test_an_elastic_run_reaches_the_parameters_and_losses_of_an_uninterrupted_one(
        make_job, references):
    check_equivalent(make_job, references, [])


def test_dropout_and_dataloader_augmentation_replay_identically_through_reformations(
        make_job, references):
    check_equivalent(make_job, references, ["--dropout", "0.2", "--loader-workers", "2"])


def test_linear_lr_scaling_sets_the_lr_from_the_world_size_at_every_reformation(make_job):
    base_lr = 0.01
    job = make_job(["--mode", "per-worker", "--epochs", "1", "--samples", "240", "--batch", "4",
                    "--lr", str(base_lr), "--hold-at", "4"], {"FAULTS": "kill:2:6"},
                   script=SCRIPT)
    job.start_together(range(3))
    assert job.wait_exit(2) == -signal.SIGKILL
    assert job.wait_exit(0) == 0 and job.wait_exit(1) == 0
    resets = [p for p in job.progress(0) if p.get("event") == "reset"]
    assert [r["world"] for r in resets][-2:] == [3, 2]
    for reset in resets:  # documented: base_lr * world_size / base_world_size (2)
        assert reset["lr"] == pytest.approx(base_lr * reset["world"] / 2, rel=1e-12)
    for entry in (p for p in job.progress(0) if "loss" in p):
        assert entry["lr"] == pytest.approx(base_lr * entry["world"] / 2, rel=1e-12)
