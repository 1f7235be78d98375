"""What a rollback resets beyond the registered state dicts: a GradScaler's per-optimizer stage
and every registered parameter's ``.grad``, after either kind of commit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic.state import TrainState

pytestmark = [pytest.mark.timeout(60), pytest.mark.unit]


class _StepFailed(Exception):
    """A peer failure stand-in: the step is abandoned after the given point."""


def _amp_state() -> TrainState:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    return TrainState(model=model, optimizer=opt, scaler=scaler)


def _amp_step(state: TrainState, fail_after_unscale: bool = False) -> None:
    """The AMP pattern of the PyTorch docs: scale, backward, unscale_, clip, step, update."""
    state.optimizer.zero_grad()
    loss = state.model(torch.randn(8, 4)).pow(2).sum()
    state.scaler.scale(loss).backward()
    state.scaler.unscale_(state.optimizer)
    torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
    if fail_after_unscale:
        raise _StepFailed("a peer died after unscale_")
    state.scaler.step(state.optimizer)
    state.scaler.update()


@pytest.mark.parametrize("commit", ["commit", "commit_live"])
def test_a_step_after_a_rollback_from_past_unscale_does_not_raise(commit):
    state = _amp_state()
    _amp_step(state)
    getattr(state, commit)()
    with pytest.raises(_StepFailed):
        _amp_step(state, fail_after_unscale=True)
    state.restore()
    _amp_step(state)  # unscale_() must not find "already been called ... since the last update()"


def _accumulating_state() -> TrainState:
    torch.manual_seed(0)
    generator, critic = nn.Linear(4, 4), nn.Linear(4, 1)
    return TrainState(generator=generator,
                      g_opt=torch.optim.SGD(generator.parameters(), lr=0.1),
                      critic=critic,
                      c_opt=torch.optim.SGD(critic.parameters(), lr=0.1))


@pytest.mark.parametrize("commit", ["commit", "commit_live"])
def test_restore_clears_the_gradients_a_half_done_step_left(commit):
    state = _accumulating_state()
    getattr(state, commit)()
    for _ in range(2):  # micro-batches accumulated, then a failure before the step
        state.critic(state.generator(torch.randn(8, 4))).sum().backward()
    state.restore()
    for module in (state.generator, state.critic):
        grads = [p.grad for p in module.parameters()]
        assert grads == [None] * len(grads)


def test_restore_clears_gradients_of_a_registered_module_no_optimizer_owns():
    torch.manual_seed(0)
    model, average = nn.Linear(4, 1), nn.Linear(4, 1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       average=average)
    state.commit()
    average(torch.randn(2, 4)).sum().backward()
    state.restore()
    assert [p.grad for p in average.parameters()] == [None, None]
