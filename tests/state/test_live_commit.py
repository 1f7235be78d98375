"""TrainState.commit_live, the copy-free commit: what it copies, what it keeps live, and how
its rollback point is restored, handed out and broadcast (a real 2-process gloo group)."""

from __future__ import annotations

import datetime

import pytest
import torch
from torch import nn

from elastic.state import ElasticSampler, StateError, TrainState
from elastic.state.live_commit import LIVE
from elastic.state.stateful import snapshot
from tests.support.gloo_group import run_in_group
from tests.support.trees import assert_same_tree

pytestmark = pytest.mark.timeout(120)


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return TrainState(model=model, optimizer=opt, scheduler=sched,
                      sampler=ElasticSampler(range(100), seed=0, batch_size=4), step=0, log=[])


def _forward_backward(state: TrainState) -> None:
    state.optimizer.zero_grad()
    state.model(torch.randn(8, 6)).pow(2).sum().backward()  # also moves BatchNorm's buffers


def _agreed_step(state: TrainState) -> int:
    """One step as the guarded block runs it: the update, the bookkeeping, the record."""
    _forward_backward(state)
    state.optimizer.step()
    state.scheduler.step()
    state.sampler.record_batch(4)
    state.step += 1
    state.log.append(state.step)
    return state.commit_live()


def _everything(state: TrainState) -> dict:
    return snapshot({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                     "scheduler": state.scheduler.state_dict(),
                     "sampler": state.sampler.state_dict(), "step": state.step,
                     "log": state.log})


def test_a_copy_free_commit_copies_no_parameter_and_no_optimizer_state():
    state = _state()
    _agreed_step(state)
    record = state._commit
    model_record, opt_record = record["model"], record["optimizer"]
    for name, _ in state.model.named_parameters():
        assert model_record[name] is LIVE
    assert all(v is LIVE for per_param in opt_record["state"].values() for v in per_param.values())
    assert isinstance(model_record["1.running_mean"], torch.Tensor), "buffers are copied"
    assert opt_record["param_groups"][0]["lr"] == pytest.approx(0.005)
    committed = state.committed()["objects"]
    for name, param in state.model.named_parameters():
        assert committed["model"][name].data_ptr() == param.data_ptr(), "handed out live"


def test_restoring_a_copy_free_commit_undoes_everything_changed_since_but_the_unapplied_step():
    state = _state()
    _agreed_step(state)
    expected = _everything(state)
    _forward_backward(state)  # a step that a failure ends before it is agreed ...
    state.sampler.record_batch(4)
    state.scheduler.step()  # ... with bookkeeping done outside the block
    state.step += 1
    state.log.append(-1)
    state.restore()
    assert_same_tree(expected, _everything(state))


def test_a_restored_copy_free_commit_trains_on_exactly_like_one_never_interrupted():
    interrupted, steady = _state(), _state()
    for state in (interrupted, steady):
        torch.manual_seed(4)
        _agreed_step(state)
    torch.manual_seed(5)
    _forward_backward(interrupted)
    interrupted.restore()
    for state in (interrupted, steady):
        torch.manual_seed(6)
        _agreed_step(state)
    assert_same_tree(_everything(steady), _everything(interrupted))


def test_snapshot_and_copy_free_commits_alternate_and_each_restores_its_own_point():
    state = _state()
    _agreed_step(state)
    state.commit()  # a full snapshot after a copy-free commit
    assert state._commit["model"]["0.weight"] is not LIVE
    after_snapshot = _everything(state)
    _agreed_step(state)  # the guarded step moved the live state: the snapshot's point is old
    state.restore()
    assert state.step == after_snapshot["step"] + 1
    state.commit()
    _agreed_step(state)
    version = _agreed_step(state)
    assert version == state.version == 6
    assert_same_tree(_everything(state), snapshot({**state.committed()["objects"]}) | {
        "model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()})


def test_a_copy_free_commit_without_a_registered_optimizer_says_to_register_it():
    state = TrainState(model=nn.Linear(2, 2), step=0)
    with pytest.raises(StateError, match="register it"):
        state.commit_live()


def _sync_a_copy_free_commit(rank: int, world: int) -> dict:
    state = _state(seed=rank)  # every rank starts different
    state.commit()
    if rank == 1:  # only the source applied more agreed steps; nothing of it is copied
        for _ in range(3):
            _agreed_step(state)
    state.sync(1, timeout=datetime.timedelta(seconds=30))
    return _everything(state) | {"version": state.version}


def test_the_newest_copy_free_commit_is_broadcast_from_the_live_state(tmp_path):
    got = run_in_group(_sync_a_copy_free_commit, 2, tmp_path)
    assert got[1]["version"] == 4 and got[1]["step"] == 3
    assert_same_tree(got[1], got[0])
