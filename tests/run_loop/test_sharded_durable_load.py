"""What a sharded job does when the checkpoint URL holds no durable sharded checkpoint: an info
line at a first start; when some shard of the last commit has no live holder, it stops with
``ShardedStateLostError`` rather than train a freshly built model under the commit's step.

Real gloo groups (``ShardedCheckpoints`` collects over the default group); the URL is a fresh
directory, as when a job starts for the first time with ``ELASTIC_CHECKPOINT`` set.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import torch

from elastic.cluster.links.process_group import ProcessGroup
from elastic.cluster.rounds.topology import Topology
from elastic.durable import DurableCommits
from elastic.foundation.events import EventLog
from elastic.sharded import ShardedRuntime, ShardedStateLostError
from elastic.sharded_durable import ShardedDurable
from elastic.state import TrainState
from elastic.state.sharded.commits import ShardCommit
from elastic.state.sharded.layout import TensorSpec
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
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}


def _rebuild_a_lost_commit(rank: int, world: int, url: str) -> str:
    durable = DurableCommits(url)
    durable.sharded = True
    runtime = ShardedRuntime(_parallelize, None, 1, TIMEOUT, timedelta(seconds=2))
    runtime.durable_loader = ShardedDurable(durable, lambda: None, dict).load
    train = TrainState(step=7)
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
        return str(exc)
    return f"trained on at step {train.step} with a fresh model"


def test_a_lost_shard_with_no_durable_checkpoint_stops_the_job_in_one_line(tmp_path: Path):
    results = run_in_group(_rebuild_a_lost_commit, 2, tmp_path, str(tmp_path / "ckpt"))
    for message in results.values():
        assert "no live holder" in message and "restart the job" in message
