"""Where a receiver of ``TrainState.sync`` lets the source's state land (its own live tensors),
and loading what it received into its objects.

Owns the choice of the tensors offered to ``feed_payload(into=...)``: the state dicts of the
registered modules and optimizers (their parameters, buffers and optimizer state are the
process's own, touched memory, and loading a state dict whose tensors are those very tensors
copies nothing), never the tensors of an object whose commit is those tensors (a copy-free
commit), which a transfer cut off half-way would leave half-written with nothing to roll back
to. Knows torch only; must not import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from elastic.state.half_step import reset_half_step

__all__ = ["landing_tree", "load_fed"]


def landing_tree(stateful: Mapping[str, Any], committed_live: Collection[str]) -> dict[str, Any]:
    """A tree shaped like ``TrainState.committed()`` holding the live tensors that may take
    the fed state in place.

    Args:
        stateful: the registered Stateful objects by name.
        committed_live: names whose commit holds their live tensors (left out).

    Returns:
        ``{"objects": {name: state_dict}}`` for the registered modules and optimizers.
    """
    return {"objects": {name: obj.state_dict() for name, obj in stateful.items()
                        if name not in committed_live
                        and isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))}}


def load_fed(stateful: Mapping[str, Any], objects: Mapping[str, Any]) -> None:
    """Loads each registered object from the received state, which it may keep (nothing else
    holds it), and resets what a half-done step left (``state.half_step``).

    A module's tensors that landed in place are its own, which ``copy_`` skips; an optimizer
    adopts the received tensors of its state.
    """
    for name, obj in stateful.items():
        obj.load_state_dict(objects[name])
    reset_half_step(stateful.values())
