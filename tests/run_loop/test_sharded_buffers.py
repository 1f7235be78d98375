"""A sharded model's buffers (batch norm's statistics: FSDP2 neither shards nor syncs them, and a
forward writes them, not ``optimizer.step()``), over real FSDP2 on a gloo group of two ranks: a
commit holds them as they were at the commit, whether it copies them on a thread after an
in-place reshard or holds the live tensors (the copy-free commit), and a reshard gives each rank
its own, not a buddy's copy of another rank's."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from elastic.sharded import ShardedRuntime
from elastic.state import TrainState
from elastic.state.sharded.layout import TensorSpec, plan_moves
from elastic.state.sharded.shards import MODEL, flat_tensors, local_part, sharded_state_dict
from tests.support.gloo_group import run_in_group
from tests.support.sharded_runtime import TIMEOUT, commit_shards, form, hold_back_copies

pytestmark = pytest.mark.timeout(300)
MEAN = f"{MODEL}1.running_mean"


def _parallelize(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.BatchNorm1d(10),
                                torch.nn.Linear(10, 3)).double()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=0.05)}


def _forward(runtime: ShardedRuntime, seed: int) -> torch.Tensor:
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return runtime.objects["model"](x).square().sum()


def _step(runtime: ShardedRuntime, seed: int) -> None:
    _forward(runtime, seed).backward()
    runtime.objects["optimizer"].step()
    runtime.objects["optimizer"].zero_grad()


def _committed(rank: int, world: int, seed: int) -> tuple[ShardedRuntime, TrainState]:
    """A formation, one step on ``seed``, and a commit whose buddy copies landed."""
    runtime = ShardedRuntime(_parallelize, None, 1, TIMEOUT, timedelta(seconds=2))
    train = TrainState(step=0)
    train.commit()
    form(runtime, train, rank, world, 1)
    _step(runtime, seed)
    commit_shards(runtime, train)
    runtime.before_commit()
    return runtime, train


def _formation_commit_while_a_forward_runs(rank: int, world: int) -> list[str]:
    runtime, train = _committed(rank, world, 0)
    runtime.settle()
    go = hold_back_copies(runtime)  # the formation's own copy: until the first forward ran
    form(runtime, train, rank, world, 2)
    formation = {n: t.clone() for n, t in runtime._live.items() if n.startswith(MODEL)}
    loss = _forward(runtime, 1)  # writes the statistics
    go.set()
    loss.backward()
    runtime.objects["optimizer"].step()
    runtime.before_commit()
    newest = runtime._commits._commits[-1]
    own = newest.held[newest.own]
    return sorted(n for n in formation if not torch.equal(own[n], formation[n]))


def test_a_formations_commit_copied_on_a_thread_holds_the_buffers_of_the_formation(tmp_path):
    for changed in run_in_group(_formation_commit_while_a_forward_runs, 2, tmp_path).values():
        assert changed == []


def _rollback_to_a_copy_free_commit(rank: int, world: int) -> list[str]:
    runtime = ShardedRuntime(_parallelize, 1, 0, TIMEOUT, timedelta(seconds=2))  # HSDP 2x1
    train = TrainState(step=0)
    train.commit()
    form(runtime, train, rank, world, 1)
    runtime.before_commit()
    runtime.confirm_copies()
    _step(runtime, 0)  # commit_step's block: the step, then the copy-free commit
    train.step += 1
    train.commit()
    runtime.commit_live(train)
    at_commit = {n: t.clone() for n, t in runtime._live.items()}
    _forward(runtime, 1)  # the next step's forward; then a peer dies
    runtime.settle()
    form(runtime, train, rank, world, 2)
    live = flat_tensors(*sharded_state_dict(runtime.objects["model"],
                                            runtime.objects["optimizer"]))
    return sorted(n for n, v in live.items() if not torch.equal(local_part(v), at_commit[n]))


def test_a_rollback_to_a_copy_free_commit_restores_the_buffers_of_the_commit(tmp_path):
    for changed in run_in_group(_rollback_to_a_copy_free_commit, 2, tmp_path).values():
        assert changed == []


def _own_statistics_after_a_reshard(rank: int, world: int) -> bool:
    runtime, train = _committed(rank, world, 100 + rank)  # each rank its own batch
    mine = runtime._live[MEAN].clone()
    runtime.settle()
    form(runtime, train, rank, world, 2)  # nobody lost
    runtime.before_commit()
    live = flat_tensors(*sharded_state_dict(runtime.objects["model"],
                                            runtime.objects["optimizer"]))
    return torch.equal(local_part(live[MEAN]), mine)


def test_a_reshard_keeps_each_ranks_own_buffers_not_its_buddys(tmp_path):
    assert run_in_group(_own_statistics_after_a_reshard, 2, tmp_path) == {0: True, 1: True}


@pytest.mark.unit
def test_a_plan_reads_each_ranks_unsharded_tensors_from_the_shard_it_trained_on():
    holders = [{0, 1}, {1, 2}, {2, 3}, {3, 0}]  # 4 ranks, ring buddies: shard s on s and s + 1
    plan = plan_moves({"buffer": TensorSpec(1, 80, sharded=False)}, 4, holders, [0, 1, 2, 3], 4,
                      own_of=[0, 1, 2, 3])
    assert [(p.dst, p.src, p.shard) for p in plan.pieces] == [(r, r, r) for r in range(4)]
