"""Issue 43 item 4: a sharded job killed outright resumes from its durable sharded checkpoint
at another world size, with the math of an uninterrupted run.

Real etcd, real worker processes (tests/workers/sharded.py, FSDP2, float64, AdamW, constant
global batch), gloo on loopback; the checkpoint is every rank's shards in DCP format. Also: a
durable checkpoint newer than every commit held whole in memory is restored entire, never its
small state over older shards.
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from elastic.checkpoint import CheckpointStore
from tests.scenarios.test_sharded_reshard import ARGS, SCRIPT, STEPS, TOLERANCE, _check, _fired
from tests.support.equivalence_scenario import max_difference

pytestmark = pytest.mark.timeout(300)


def test_a_sharded_job_killed_at_4_resumes_from_its_durable_checkpoint_at_3(
        make_job, references, tmp_path):
    # The uninterrupted run of test_sharded_reshard.py's kill-and-join cases.
    reference = references.start(make_job, SCRIPT, ARGS)
    url = str(tmp_path / "ckpt")
    store = CheckpointStore(url)
    env = {"ELASTIC_CHECKPOINT": url}
    first = make_job(ARGS + ["--durable"], env, script=SCRIPT)
    first.start_together(range(4))
    first.wait_until(lambda: any(ref.epoch == 1 for ref in store.list()), 120,
                     "the durable sharded commit of epoch 1")
    for i in range(4):
        first.signal(i, signal.SIGKILL)
    for i in range(4):
        assert first.wait_exit(i) == -signal.SIGKILL
    saved = next(ref for ref in store.list() if ref.epoch == 1)
    assert saved.manifest.payload_format == "torch.distributed.checkpoint"
    assert saved.world_size == 4 and {"__3_0.distcp", "state.pt"} <= set(saved.manifest.files)

    resumed = make_job(ARGS + ["--durable"], env, script=SCRIPT)
    resumed.start_together(range(3))
    want = reference.result()
    for i in range(3):
        assert resumed.wait_exit(i) == 0, resumed.tails()
        got = resumed.result(i)
        assert got["step"] == STEPS
        assert got["restored"][0] == [3, True]  # its parameters NaN until the load fills them
        assert max_difference(got["params"], want["params"]) <= TOLERANCE
        assert max_difference(got["history"], want["history"]) <= TOLERANCE
        for epoch, seen in enumerate(got["ledger"]):
            assert sorted(Counter(seen).items()) == [(i, 1) for i in range(96)], epoch
    loaded = [e for e in resumed.events() if e["event"] == "checkpoint_loaded"
              and e.get("sharded")]
    assert loaded and loaded[0]["version"] == saved.step and loaded[0]["from_world"] == 4
    first_steps = [p for p in resumed.progress(0) if "loss" in p]
    assert first_steps[0]["step"] == STEPS // 2 + 1 and first_steps[0]["world"] == 3


def test_a_durable_checkpoint_newer_than_the_commits_held_in_memory_is_restored_whole(
        make_job, references, tmp_path):
    # Step 14's commit is durable and agrees on a join, so its shards get no buddy copies; rank
    # 1 dies inside parallelize at the join's formation (world 5). The newest commit held whole
    # in memory is then step 12's: the job must restore step 14 from the checkpoint, shards and
    # small state together, not step 12's shards under step 14's sampler, ledger and history.
    reference = references.start(make_job, SCRIPT, ARGS)
    env = {"ELASTIC_CHECKPOINT": str(tmp_path / "ckpt"), "FAULT": "kill:1:14:5:parallelize"}
    job = make_job(ARGS + ["--durable-at-join", "14"], env, script=SCRIPT)
    job.start_together(range(4))
    job.wait_until(lambda: all((job.out / f"holding-{i}").exists() for i in range(4)), 150,
                   "every worker holding after step 14")
    (job.out / "join-started").touch()
    job.start(4)
    job.wait_until(lambda: any(_fired(job, i) for i in range(5)), 150, "the kill")
    killed = next(i for i in range(5) if _fired(job, i))
    assert job.wait_exit(killed) == -signal.SIGKILL
    _check(job, reference, [i for i in range(5) if i != killed], resharded=False)
    loaded = [e for e in job.events() if e["event"] == "checkpoint_loaded" and e.get("sharded")]
    assert [e["from_world"] for e in loaded] == [4] * 4  # once, by each survivor
    assert len({e["version"] for e in loaded}) == 1
