"""A small float64 FSDP2 model on a CPU mesh, trained a few deterministic steps with Adam.

Imports torch only (never ``elastic``): the plain-DCP reader of the sharded checkpoint tests
builds the same model without the library. The layer sizes (11, 10, 7 rows) shard unevenly over
3, 4 and 5 ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def build(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model, fully sharded over ``world`` CPU ranks, and its Adam optimizer."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 11), torch.nn.Tanh(), torch.nn.Linear(11, 10),
                                torch.nn.Tanh(), torch.nn.Linear(10, 7)).double()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    """``steps`` optimizer steps on this rank's own deterministic batches."""
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 6, dtype=torch.float64, generator=gen)
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def sharded_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's sharded state dict (DTensors), as DCP saves and loads it."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optimizer": optim_sd}


def apply(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Loads a (loaded-into) sharded state dict into the model and optimizer."""
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and Adam moment, unsharded, on the CPU (a collective)."""
    model_sd, optim_sd = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model_sd, "optimizer": optim_sd.get("state", {})}


def differences(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """The names of the parameters and optimizer values that are not exactly equal."""
    out = [k for k, v in expected["model"].items() if not torch.equal(v, got["model"].get(k))]
    for name, values in expected["optimizer"].items():
        out += [f"{name}.{key}" for key, v in values.items()
                if not torch.equal(torch.as_tensor(v), torch.as_tensor(got["optimizer"][name][key]))]
    return out


def count(state: dict[str, Any]) -> int:
    """How many tensors ``differences`` compares."""
    return len(state["model"]) + sum(len(v) for v in state["optimizer"].values())
