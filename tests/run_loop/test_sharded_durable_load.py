"""What a sharded job does when some shard of the last commit has no live holder: it resumes
from the newest durable sharded checkpoint with one warning that says what was lost, or, when the
checkpoint URL holds none, stops with ``ShardedStateLostError`` (and no warning that promised a
fallback) rather than train a freshly built model under the commit's step; at a first start an
empty URL is one info line.

Real gloo groups (``ShardedCheckpoints`` collects over the default group); the URL is a fresh
directory, as when a job starts for the first time with ``ELASTIC_CHECKPOINT`` set.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from elastic.cluster.links.process_group import ProcessGroup
from elastic.cluster.rounds.topology import Topology
from elastic.durable import DurableCommits
from elastic.foundation.events import EventLog
from elastic.sharded import ShardedRuntime, ShardedStateLostError
from elastic.sharded_durable import ShardedDurable
from elastic.state import TrainState
from elastic.state.sharded.commits import ShardCommit
from elastic.state.sharded.layout import TensorSpec
from elastic.state.sharded.optimizer_state import make_state
from tests.support.gloo_group import run_in_group

TIMEOUT = timedelta(seconds=30)


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))


def _load_from_an_empty_url(rank: int, world: int, url: str) -> list[dict]:
    handler = _Kept()
    logger = logging.getLogger("elastic.sharded_durable")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    durable = DurableCommits(url)
    durable.sharded = True
    model = torch.nn.Linear(3, 2)
    objects = {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}
    loader = ShardedDurable(durable, lambda: None, dict)
    results = []
    for load in (lambda: loader.load(objects), lambda: loader.load(objects, lost=True)):
        handler.records.clear()
        results.append({"small": load(), "logged": list(handler.records)})
    return results


def test_an_empty_checkpoint_url_at_a_first_start_is_one_info_line(tmp_path: Path):
    url = str(tmp_path / "ckpt")
    first_start, lost = run_in_group(_load_from_an_empty_url, 1, tmp_path, url)[0]
    assert first_start["small"] is None
    assert [level for level, m in first_start["logged"]] == [logging.INFO]
    assert url in first_start["logged"][0][1]
    assert lost == {"small": None, "logged": []}  # the runtime stops the job instead


def _parallelize(mesh):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3)).double()
    if mesh is None:  # the same objects, not sharded
        return {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}


def _write_durable_at_step_3(durable: DurableCommits, train: TrainState) -> None:
    """A durable sharded checkpoint of step 3, written from plain (unsharded) objects of the
    same structure: DCP reshards it into the FSDP objects at load."""
    objects = _parallelize(None)
    make_state(objects["optimizer"])
    model_sd, optim_sd = get_state_dict(objects["model"], objects["optimizer"])
    train.commit()
    ShardedDurable(durable, lambda: None, lambda: {"world_size": 2}).write(
        train.version, {"model": model_sd, "optimizer": optim_sd}, train.committed())


def _rebuild_a_lost_commit(rank: int, world: int, url: str, durable_first: bool
                           ) -> tuple[str, list[str]]:
    handler = _Kept()
    logging.getLogger("elastic.sharded").addHandler(handler)
    durable = DurableCommits(url)
    durable.sharded = True
    runtime = ShardedRuntime(_parallelize, None, 1, TIMEOUT, timedelta(seconds=2))
    runtime.durable_loader = ShardedDurable(durable, lambda: None, dict).load
    train = TrainState(step=3)
    if durable_first:
        _write_durable_at_step_3(durable, train)
    train.step = 7
    train.commit()
    # the last commit of a 3-rank round whose rank 2 died before its buddy copy landed
    commit = ShardCommit(train.version, 3, 3, rank, {"w": TensorSpec(6, 4)},
                         {"version": train.version, "objects": dict(train.committed()["objects"])})
    commit.held[rank] = {"w": torch.zeros(2, 4, dtype=torch.float64)}
    runtime._commits.add(commit)
    topology = Topology(round=2, rank=rank, world_size=world, member_id=f"m{rank}", rank0="m0",
                        master_addr="127.0.0.1", master_port=0, store_prefix="", lineage=2)
    group = ProcessGroup("gloo", TIMEOUT, frozenset(), timedelta(seconds=10))
    runtime.choose(topology, train, group)
    try:
        runtime.rebuild(topology, train, EventLog(None, f"rank{rank}"), group)
    except ShardedStateLostError as exc:
        outcome = str(exc)
    else:
        outcome = f"trained on at step {train.step}"
    return outcome, [m for level, m in handler.records if level >= logging.WARNING]


def test_a_lost_shard_with_no_durable_checkpoint_stops_the_job_in_one_line(tmp_path: Path):
    results = run_in_group(_rebuild_a_lost_commit, 2, tmp_path, str(tmp_path / "ckpt"), False)
    for message, warnings in results.values():
        assert "no live rank holds every shard" in message and "restart the job" in message
        assert "newest: version 1" in message  # what was lost
        assert warnings == [], "no line may promise a fallback that does not happen"


def test_a_lost_shard_resumes_from_the_durable_checkpoint_with_one_line_saying_what_was_lost(
        tmp_path: Path):
    results = run_in_group(_rebuild_a_lost_commit, 2, tmp_path, str(tmp_path / "ckpt"), True)
    for outcome, warnings in results.values():
        assert outcome == "trained on at step 3"
        assert len(warnings) == 1
        assert "version 2" in warnings[0] and "durable sharded checkpoint (version 1)" in \
            warnings[0] and "lost" in warnings[0]


def _resume_past_corrupt_shards(rank: int, world: int, url: str) -> str:
    import torch.distributed as dist

    durable = DurableCommits(url)
    durable.sharded = True
    runtime = ShardedRuntime(_parallelize, None, 1, TIMEOUT, timedelta(seconds=2))
    runtime.durable_loader = ShardedDurable(durable, lambda: None, dict).load
    train = TrainState(step=3)
    _write_durable_at_step_3(durable, train)  # the small state now at its version, as at a
    if rank == 0:  # resume that read it; one flipped byte in every rank's shard file
        for shard in Path(url).glob("*/*.distcp"):
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
    dist.barrier()
    topology = Topology(round=1, rank=rank, world_size=world, member_id=f"m{rank}", rank0="m0",
                        master_addr="127.0.0.1", master_port=0, store_prefix="", lineage=1)
    group = ProcessGroup("gloo", TIMEOUT, frozenset(), timedelta(seconds=10))
    runtime.choose(topology, train, group)
    try:  # rank 0 read the small state from the checkpoint and synced it
        runtime.rebuild(topology, train, EventLog(None, f"rank{rank}"), group, from_durable=True)
    except ShardedStateLostError as exc:
        return str(exc)
    return f"trained on at step {train.step} with a fresh model"


def test_a_resume_whose_sharded_checkpoint_has_corrupt_shards_stops_in_one_line(
        tmp_path: Path):
    results = run_in_group(_resume_past_corrupt_shards, 2, tmp_path, str(tmp_path / "ckpt"))
    for message in results.values():
        assert "version 1" in message and "could not be loaded for its shards" in message


def _write_when_rank_0_cannot_ready_it(rank: int, world: int, url: str) -> tuple[str, str]:
    from elastic.foundation.errors import EtcdUnavailableError

    durable = DurableCommits(url)
    durable.sharded = True
    if rank == 0:  # the rank armed with the fencing token: its claim of the epoch fails
        def unreachable(metadata):
            raise EtcdUnavailableError("etcd did not answer the fencing epoch's claim")
        durable.publish_metadata = unreachable  # type: ignore[method-assign]
    _write_durable_at_step_3(durable, TrainState(step=3))
    # both ranks are back in training: the next collective is the next step's
    step = torch.tensor([rank], dtype=torch.int64)
    torch.distributed.all_reduce(step)
    return type(durable.last_error).__name__, f"step collective {int(step)}"


def test_a_sharded_write_that_rank_0_cannot_ready_is_skipped_by_every_rank_together(
        tmp_path: Path):
    results = run_in_group(_write_when_rank_0_cannot_ready_it, 2, tmp_path,
                           str(tmp_path / "ckpt"), timeout_s=120)
    assert results == {0: ("EtcdUnavailableError", "step collective 1"),
                       1: ("CheckpointError", "step collective 1")}
