"""What a sharded formation's first step waits for: the optimizer's moments that a reshard lands
on a thread reach every hook of the user's whole, and a landing that fails on this rank for a
reason of its own stops the step with that reason instead of training on half-landed state; the
job's end waits for the copies still in flight."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from elastic.sharded import ShardedRuntime, waits_first
from elastic.state import TrainState
from elastic.state.sharded.commits import ShardCommit, ShardCommits
from elastic.state.sharded.copies import BuddyExchange
from elastic.state.sharded.layout import TensorSpec
from tests.support.gloo_group import run_in_group
from tests.support.sharded_runtime import TIMEOUT, commit_shards, form, hold_back_copies

pytestmark = pytest.mark.timeout(120)


@pytest.mark.unit
def test_the_runtimes_wait_runs_before_every_hook_the_user_registered_earlier():
    # A step pre-hook registered in parallelize ran before the runtime's wait and read the
    # optimizer's moments before they landed.
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    calls: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("user step"))
    optimizer.register_state_dict_pre_hook(lambda *_: calls.append("user state_dict"))
    optimizer.register_load_state_dict_pre_hook(lambda *_: calls.append("user load"))
    hooks = waits_first(optimizer, lambda *_: calls.append("wait"))
    weight.grad = torch.ones(2)
    optimizer.step()
    optimizer.load_state_dict(optimizer.state_dict())
    assert calls == ["wait", "user step", "wait", "user state_dict", "wait", "user load"]
    for hook in hooks:
        hook.remove()
    optimizer.step()
    assert calls[-1] == "user step" and calls.count("wait") == 3


@pytest.mark.unit
def test_a_landing_that_fails_for_a_reason_of_its_own_stops_the_first_step_with_it():
    # Only RuntimeError and ValueError (a peer failing) were recorded: any other error ended
    # the exchange's thread unrecorded, and the first step trained on what had not landed.
    specs = {"w": TensorSpec(4, 8)}
    commits = ShardCommits(max_held=1)
    commit = ShardCommit(3, 1, 1, 0, specs, {"version": 3, "objects": {}})
    commits.add(commit)
    exchange = BuddyExchange(None, 0, 1, 0, [0])  # a world of one: no buddies, no group

    def landing() -> None:
        raise KeyError("w")

    exchange.start(commit, commits, own_from={"w": torch.zeros(4, 1, dtype=torch.float64)},
                   landing=landing)
    with pytest.raises(KeyError):
        exchange.wait_own(timedelta(seconds=30))
    with pytest.raises(KeyError):
        exchange.wait(timedelta(seconds=30))


def _parallelize(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3)).double()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=0.05)}


def _end_with_copies_in_flight(rank: int, world: int) -> dict:
    runtime = ShardedRuntime(_parallelize, None, 1, TIMEOUT, timedelta(seconds=2))
    train = TrainState(step=0)
    train.commit()
    form(runtime, train, rank, world, 1)
    runtime.objects["model"](torch.ones(4, 6, dtype=torch.float64)).sum().backward()
    runtime.objects["optimizer"].step()
    go = hold_back_copies(runtime)  # this commit's copies: until the end let them go
    commit_shards(runtime, train)
    ended = threading.Event()
    ending = threading.Thread(target=lambda: (runtime.wait_copies(), ended.set()))
    ending.start()
    waited = not ended.wait(0.5)  # bounded: it must still be waiting for the held copy
    go.set()
    ending.join(TIMEOUT.total_seconds())
    newest = runtime._commits._commits[-1]
    return {"waited": waited, "ended": ended.is_set(), "copies_held": sorted(newest.held),
            "objects_kept": sorted(runtime.objects)}


def test_the_jobs_end_waits_for_the_copies_in_flight_and_keeps_the_objects(tmp_path):
    # Nothing waited for the exchange's thread when the training function returned: the
    # process could exit with a copy cut off inside a gloo call.
    for result in run_in_group(_end_with_copies_in_flight, 2, tmp_path).values():
        assert result == {"waited": True, "ended": True, "copies_held": [0, 1],
                          "objects_kept": ["model", "optimizer"]}
