"""What a half-done step leaves outside the registered objects' state dicts, and its reset.

Owns the part of a rollback that ``load_state_dict`` does not do: a GradScaler's per-optimizer
stage (``unscale_`` done, step taken), which its state dict does not carry, and the ``.grad``
of every registered parameter, which no state dict carries. Both belong to the step being
abandoned: left in place, the next ``unscale_`` raises, and the re-served micro-batches'
gradients are added to the abandoned step's. Knows torch only.

Checked and needing nothing here: LR schedulers (their state dict and the optimizer's
``param_groups`` hold all they read), ``swa_utils.AveragedModel`` (its count is a buffer; its
parameters are a module's), autocast's cast cache (emptied whenever the outermost autocast
region exits, an exception included), ``torch.compile``'s guards (a rollback loads state into
the same tensors, so no guard sees a new object).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["reset_half_step"]


def _is_grad_scaler(obj: Any) -> bool:
    # torch.cuda.amp.GradScaler subclasses torch.amp.GradScaler.
    return isinstance(obj, torch.amp.GradScaler)


def _parameters(obj: Any) -> Iterable[torch.Tensor]:
    """The parameters ``obj`` trains or holds: a module's, or every group's of an optimizer."""
    if isinstance(obj, torch.nn.Module):
        return obj.parameters()
    groups = getattr(obj, "param_groups", None)
    if isinstance(groups, list):
        return (p for group in groups for p in group.get("params", ()))
    return ()


def reset_half_step(objects: Iterable[Any]) -> None:
    """Returns what a half-done step left in ``objects`` to the state of a step not begun.

    Every GradScaler's per-optimizer stage is reset as ``update()`` resets it, and every
    parameter of every module and optimizer gets ``.grad = None`` (as ``zero_grad()`` does).

    Args:
        objects: the registered Stateful objects.
    """
    for obj in objects:
        if _is_grad_scaler(obj):
            # What GradScaler.update() does to end a step; load_state_dict() leaves it.
            stages = getattr(obj, "_per_optimizer_states", None)
            if stages is not None:
                stages.clear()  # a defaultdict: each optimizer starts at the READY stage again
        for param in _parameters(obj):
            if isinstance(param, torch.Tensor):
                param.grad = None
