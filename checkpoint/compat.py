"""Checking that a loaded state fits the live one before anything is copied into it.

The check compares the two nested structures key by key: a missing or unexpected key, a tensor
where a plain value is expected (or the reverse), or a tensor of another shape is an error that
names the key and both sides. It does no I/O and knows no training objects.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from elastic.checkpoint.errors import CheckpointIncompatibleError


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _leaves(value, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, obj


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} value"


def check_compatible(loaded: Any, live: Any) -> None:
    """Raises if ``loaded`` cannot be loaded into ``live`` (same keys, same tensor shapes).

    Plain values may differ (they are state); tensor dtypes may differ (``load_state_dict``
    converts). Nested keys are reported dotted, e.g. ``model.layer.0.weight``.

    Args:
        loaded: The state read from a checkpoint.
        live: The state of the objects it is about to be loaded into.

    Raises:
        CheckpointIncompatibleError: A key is missing or unexpected, or a shape or kind differs.
    """
    have, want = dict(_leaves(loaded)), dict(_leaves(live))
    missing = sorted(set(want) - set(have))
    if missing:
        raise CheckpointIncompatibleError(
            f"checkpoint lacks key {missing[0]!r} that the live state has "
            f"({len(missing)} missing in all: {missing[:5]}).")
    unexpected = sorted(set(have) - set(want))
    if unexpected:
        raise CheckpointIncompatibleError(
            f"checkpoint has key {unexpected[0]!r} that the live state lacks "
            f"({len(unexpected)} unexpected in all: {unexpected[:5]}).")
    for key, value in want.items():
        old = have[key]
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor != isinstance(old, torch.Tensor) or (is_tensor and old.shape != value.shape):
            raise CheckpointIncompatibleError(
                f"key {key!r}: checkpoint has a {_describe(old)}, the live state a "
                f"{_describe(value)}.")
