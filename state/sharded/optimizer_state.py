"""An optimizer's per-parameter state, made without a step, for objects a reshard fills next.

torch's ``get_state_dict`` and ``set_state_dict`` need the optimizer's state to exist; on a
fresh optimizer they make it by taking one step with zero gradients and a learning rate of
0, which runs the optimizer's whole arithmetic over every element of every shard. A
formation that reshards a commit overwrites all of that state straight away, so it only needs
the state's layout. Owns ``make_state``: it steps the optimizer's own class once, on two small
stand-ins of different lengths per parameter group, dtype and device (the group's options,
zero gradients, learning rate 0, as torch's step), and gives every parameter what the
stand-ins got: a 0-dim entry (a step count) as a copy, an entry shaped like each stand-in and
of one value as a tensor like the parameter (a DTensor for a DTensor) filled with that value,
anything else that is not a tensor as it is; with ``filled=False`` the entries shaped like the
parameter are left unwritten, for a reshard that writes every one of them next. When it cannot
tell (the class will not build on stand-ins, entries of another shape or of several values),
it makes nothing and torch takes its step as before. Torch only.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic.state.sharded.shards import local_part

STAND_INS = ((2,), (3,))  # a parameter-shaped entry follows their shapes; a count has ()


def make_state(optimizer: torch.optim.Optimizer, filled: bool = True) -> bool:
    """Gives every trainable parameter of ``optimizer`` the state its first step would give
    it, without stepping ``optimizer``; returns whether the state exists now (False: nothing
    was made, and torch's ``get_state_dict`` will take its own step). ``filled=False``: the
    entries shaped like a parameter get its layout, not the step's values, and the caller
    writes every one of them before the state is read or the optimizer steps."""
    if optimizer.state:
        return True
    made: dict[torch.Tensor, dict[str, Any]] = {}
    probes: dict[tuple[int, torch.dtype, torch.device], dict[str, Any] | None] = {}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if not param.requires_grad:
                continue
            if param.grad is not None:
                return False  # torch takes no step then either: the state is the optimizer's
            local = local_part(param)
            key = (index, param.dtype, local.device)
            if key not in probes:
                probes[key] = _probe(type(optimizer), group, param.dtype, local.device)
            probe = probes[key]
            if probe is None:
                return False
            made[param] = {name: _like(param, value, filled) for name, value in probe.items()}
    for param, state in made.items():
        optimizer.state[param] = state
    return True


def _probe(cls: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype,
           device: torch.device) -> dict[str, Any] | None:
    """The state a parameter gets from one step of ``cls`` with ``group``'s options at
    learning rate 0 and a zero gradient, told from two stand-ins; None when it cannot be."""
    stand_ins = [torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
                 for shape in STAND_INS]
    options = {name: value for name, value in group.items() if name != "params"}
    if "lr" in options:
        options["lr"] = torch.tensor(0.0) if isinstance(options["lr"], torch.Tensor) else 0.0
    probe = None
    for kwargs in ({}, {"lr": 0.0}):  # options the constructor may not take go in afterwards
        try:
            probe = cls(stand_ins, **kwargs)
            break
        except (TypeError, ValueError):
            continue
    if probe is None:
        return None
    probe.param_groups[0].update(options)
    for stand_in in stand_ins:
        stand_in.grad = torch.zeros_like(stand_in)
    try:
        probe.step()
    except (TypeError, ValueError, RuntimeError, KeyError):
        return None
    states = [dict(probe.state.get(stand_in, {})) for stand_in in stand_ins]
    if any(state.keys() != states[0].keys() for state in states):
        return None
    for name, value in states[0].items():
        if isinstance(value, (list, dict, set)):
            return None
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        seen = [state[name] for state in states]
        if any(tuple(v.shape) != shape for v, shape in zip(seen, STAND_INS)):
            return None
        if any(not torch.equal(v, torch.full_like(v, value.flatten()[0].item())) for v in seen):
            return None
    return states[0]


def _like(param: torch.Tensor, value: Any, filled: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:
        return value.clone()
    if not filled:
        return torch.empty_like(param, dtype=value.dtype).detach()
    return torch.full_like(param, value.flatten()[0].item(), dtype=value.dtype).detach()
