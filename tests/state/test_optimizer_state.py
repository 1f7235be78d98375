"""The optimizer state a reshard makes without a step has the layout torch's own first step
makes (names, shapes, dtypes, DTensor placements, values; unfilled for a reshard, all but
the values of its moments), and the optimizer is never stepped."""

from __future__ import annotations

import pytest
import torch

from tests.support.gloo_group import run_in_group

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "rmsprop-centered": (torch.optim.RMSprop, {"lr": 1e-3, "centered": True, "momentum": 0.5}),
}


class _Blocky(torch.optim.Optimizer):
    """Keeps one state entry of its own shape per parameter: not elementwise."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param].setdefault("block", torch.zeros(2))


def _layouts(rank: int, world: int, kind: str, filled: bool = True) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from elastic.state.sharded.optimizer_state import make_state
    from elastic.state.sharded.shards import flat_tensors

    def built(cls, options):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, (cls(model.parameters(), **options) if options is not None
                       else cls(model.parameters()))

    cls, options = OPTIMIZERS[kind] if kind in OPTIMIZERS else (_Blocky, None)
    steps = []
    model, optimizer = built(cls, options)
    optimizer.register_step_pre_hook(lambda *_: steps.append("ours"))
    if filled:
        made = make_state(optimizer)
    else:  # nothing may be written: a fill of an entry like a parameter fails here
        fill = torch.full_like

        def refused(value, *args, **kwargs):
            if isinstance(value, DTensor):  # the stand-ins the state is told from are plain
                raise AssertionError("make_state(filled=False) filled an entry")
            return fill(value, *args, **kwargs)

        torch.full_like = refused
        try:
            made = make_state(optimizer, filled=False)
        finally:
            torch.full_like = fill
    ours = flat_tensors(*get_state_dict(model, optimizer))
    model, optimizer = built(cls, options)
    optimizer.register_step_pre_hook(lambda *_: steps.append("torch"))
    theirs = flat_tensors(*get_state_dict(model, optimizer))

    def layout(flat):
        return {name: (tuple(v.shape), v.dtype, isinstance(v, DTensor),
                       tuple(v.placements) if isinstance(v, DTensor) else ())
                for name, v in flat.items()}

    def local(v):
        return v.to_local() if isinstance(v, DTensor) else v

    return {"made": made, "steps": steps, "same_layout": layout(ours) == layout(theirs),
            "same_values": made and all(torch.equal(local(ours[n]), local(theirs[n]))
                                        for n in theirs),
            "same_counts": all(torch.equal(local(ours[n]), local(theirs[n]))
                               for n in theirs if theirs[n].dim() == 0),
            "names": sorted(ours)}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_the_state_made_without_a_step_is_laid_out_and_filled_as_torchs_first_step_makes_it(
        tmp_path, kind):
    results = run_in_group(_layouts, 2, tmp_path, kind)
    for rank, result in results.items():
        assert result["made"], f"rank {rank}: no state made for {kind}"
        assert result["steps"] == ["torch"], f"rank {rank}: steps taken {result['steps']}"
        assert result["same_layout"], f"rank {rank}: {kind}'s layout differs from torch's"
        assert result["same_values"], f"rank {rank}: {kind}'s values differ from torch's"
        assert any(name.startswith("optim/") for name in result["names"])


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_the_state_made_unfilled_for_a_reshard_has_torchs_layout_and_step_counts(tmp_path, kind):
    results = run_in_group(_layouts, 2, tmp_path, kind, False)
    for rank, result in results.items():
        assert result["made"] and result["steps"] == ["torch"], f"rank {rank}: {result}"
        assert result["same_layout"] and result["same_counts"], f"rank {rank}: {result}"


def test_an_optimizer_whose_state_is_not_elementwise_is_left_to_torchs_step(tmp_path):
    results = run_in_group(_layouts, 2, tmp_path, "blocky")
    for rank, result in results.items():
        assert not result["made"], f"rank {rank}: made a state it cannot know"
        assert result["steps"] == ["ours", "torch"]  # both took torch's step
        assert result["same_layout"]
