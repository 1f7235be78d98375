"""Which local parts may take a reshard in place: only the objects' own tensors, all of them."""

from __future__ import annotations

import pytest
import torch

from elastic.state.sharded.shards import flat_tensors, hold_every_tensor, sharded_state_dict

pytestmark = pytest.mark.unit


def _stepped() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {name: value.detach()
            for name, value in flat_tensors(*sharded_state_dict(model, optimizer)).items()}


def test_the_state_dicts_tensors_are_the_objects_own_so_a_reshard_may_write_them_in_place():
    model, optimizer = _stepped()
    assert hold_every_tensor(_parts(model, optimizer), model, optimizer)


class _Counting(torch.nn.Linear):
    """Keeps a count as extra state: its state dict entry is a new tensor each time."""

    seen = 0

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([self.seen])

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.seen = int(state[0])


def test_a_state_dict_tensor_that_is_no_objects_own_keeps_the_reshard_out_of_place():
    model = _Counting(3, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    parts = _parts(model, optimizer)
    assert "model/_extra_state" in parts
    assert not hold_every_tensor(parts, model, optimizer)


def test_a_parameter_missing_from_the_parts_would_stay_unwritten_so_none_is_written_in_place():
    model, optimizer = _stepped()
    parts = _parts(model, optimizer)
    del parts["model/0.weight"]
    assert not hold_every_tensor(parts, model, optimizer)
