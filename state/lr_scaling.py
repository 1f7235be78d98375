"""Learning-rate policies for per-worker-batch training, applied at every re-formation.

Owns ``LinearLRScaling`` and ``SqrtLRScaling``: callables for ``ElasticState.on_reset`` that
set each parameter group's learning rate from a fixed base and the current world size, so
the global batch (which grows with the world in this mode) and the step size stay matched.
They read only ``state.world_size``; must not import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["LinearLRScaling", "SqrtLRScaling", "WorldSizeLRScaling"]


class WorldSizeLRScaling:
    """Sets ``lr = base_lr * factor(world_size / base_world_size)`` in every parameter group.

    The rate is always computed from ``base_lr``, never from the current ``lr``, so it does
    not compound over re-formations (the optimizer's ``lr`` is also rolled back with its
    state before the callback runs). A scheduler that owns the LR should scale its own
    base instead; this class is for constant or externally driven rates.

    Args:
        optimizer: The optimizer whose parameter groups to set.
        base_lr: The rate at ``base_world_size``: one float for all groups, one per group,
            or None to take the groups' rates at construction.
        base_world_size: The world size ``base_lr`` was tuned for.

    Raises:
        ValueError: ``base_world_size`` < 1, or ``base_lr`` has the wrong length.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 base_lr: float | Sequence[float] | None = None,
                 base_world_size: int = 1) -> None:
        groups = optimizer.param_groups
        if base_world_size < 1:
            raise ValueError(f"base_world_size ({base_world_size}) must be >= 1.")
        if base_lr is None:
            rates = [float(g["lr"]) for g in groups]
        elif isinstance(base_lr, (int, float)):
            rates = [float(base_lr)] * len(groups)
        else:
            rates = [float(r) for r in base_lr]
        if len(rates) != len(groups):
            raise ValueError(f"base_lr has {len(rates)} rates for {len(groups)} parameter "
                             f"groups; pass one float or one rate per group.")
        self.optimizer = optimizer
        self.base_lrs = rates
        self.base_world_size = int(base_world_size)

    def factor(self, world_size: int) -> float:
        """The multiplier of ``base_lr`` at ``world_size``. Subclasses define it."""
        raise NotImplementedError

    def lr(self, world_size: int) -> list[float]:
        """The rates of the parameter groups at ``world_size``."""
        return [rate * self.factor(world_size) for rate in self.base_lrs]

    def __call__(self, state: Any) -> None:
        """Applies the policy for ``state.world_size`` (the ``on_reset`` signature)."""
        for group, rate in zip(self.optimizer.param_groups, self.lr(int(state.world_size))):
            group["lr"] = rate


class LinearLRScaling(WorldSizeLRScaling):
    """``lr = base_lr * world_size / base_world_size`` (Goyal et al., 2017).

    See ``WorldSizeLRScaling`` for the arguments.
    """

    def factor(self, world_size: int) -> float:
        """See base class."""
        return world_size / self.base_world_size


class SqrtLRScaling(WorldSizeLRScaling):
    """``lr = base_lr * sqrt(world_size / base_world_size)`` (for adaptive optimizers).

    See ``WorldSizeLRScaling`` for the arguments.
    """

    def factor(self, world_size: int) -> float:
        """See base class."""
        return math.sqrt(world_size / self.base_world_size)
