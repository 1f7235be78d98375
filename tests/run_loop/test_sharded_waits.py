"""What a sharded formation's first step waits for: the optimizer's moments that a reshard lands
on a thread reach every hook of the user's whole, and a landing that fails on this rank for a
reason of its own stops the step with that reason instead of training on half-landed state."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from elastic.sharded import waits_first
from elastic.state.sharded.commits import ShardCommit, ShardCommits
from elastic.state.sharded.copies import BuddyExchange
from elastic.state.sharded.layout import TensorSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


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
