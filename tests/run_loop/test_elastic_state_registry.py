"""ElasticState holds its objects in a TrainState, and they read as its own plain attributes."""

from __future__ import annotations

import pytest
import torch

from elastic import ElasticState, TrainState

pytestmark = pytest.mark.unit


def test_registered_objects_are_plain_attributes_of_the_elastic_state():
    model = torch.nn.Linear(2, 1)
    state = ElasticState(model=model, step=0)
    assert vars(state)["model"] is model and vars(state)["step"] == 0  # no __getattr__ per read
    assert isinstance(state.train_state, TrainState) and state.train_state.model is model


def test_a_plain_value_written_on_the_elastic_state_is_committed_and_restored():
    state = ElasticState(step=0, history=[])
    state.step += 3
    assert state.train_state.value_of("step") == 3
    assert state.commit() == 1
    state.step, state.history = 9, [1]
    state.restore()
    assert (state.step, state.history) == (3, [])


def test_unregistered_names_and_replaced_stateful_objects_are_refused_with_the_fix():
    state = ElasticState(model=torch.nn.Linear(2, 1))
    with pytest.raises(AttributeError, match="call register"):
        state.epoch = 1
    with pytest.raises(AttributeError, match="load_state_dict"):
        state.model = torch.nn.Linear(2, 1)
    with pytest.raises(AttributeError, match="no attribute or registered object 'epoch'"):
        _ = state.epoch
    with pytest.raises(ValueError, match="clashes with ElasticState.rank"):
        state.register("rank", 0)
