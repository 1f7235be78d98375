"""Plain values of a ``TrainState`` (ints, floats, strings, tensors, and dicts, lists and tuples of
them): what counts as one, and how a snapshotted one is put back. No collectives, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from elastic.state.stateful import snapshot

_PLAIN_LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.Tensor)


def check_plain(name: str, value: Any) -> None:
    """Raises TypeError unless ``value`` is a plain value (or a dict/list/tuple of them)."""
    if isinstance(value, _PLAIN_LEAVES):
        return
    if isinstance(value, Mapping):
        for item in value.values():
            check_plain(name, item)
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            check_plain(name, item)
        return
    raise TypeError(
        f"{name!r} holds a {type(value).__name__}, which is neither Stateful (state_dict/"
        f"load_state_dict) nor a plain value (int, float, str, bool, None, tensor, dict/list)."
    )


def restore_value(saved: Any, live: Any) -> Any:
    """Copies a snapshotted plain value back, putting tensors on the live tensor's device."""
    if isinstance(saved, torch.Tensor):
        device = live.device if isinstance(live, torch.Tensor) else torch.device("cpu")
        return saved.to(device, copy=True)
    if isinstance(saved, Mapping):
        live_map = live if isinstance(live, Mapping) else {}
        return type(saved)((k, restore_value(v, live_map.get(k))) for k, v in saved.items())
    if isinstance(saved, (list, tuple)):
        same = isinstance(live, (list, tuple)) and len(live) == len(saved)
        lives = live if same else [None] * len(saved)
        items = [restore_value(v, lv) for v, lv in zip(saved, lives)]
        return items if isinstance(saved, list) else type(saved)(items)
    return snapshot(saved)
