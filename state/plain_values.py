"""Plain values of a ``TrainState`` (ints, floats, strings, tensors, and dicts, lists and tuples of
them): what counts as one, and how a snapshotted one is put back. No collectives, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from elastic.state.stateful import rebuild_mapping, rebuild_sequence, snapshot

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
    hint = " (a numpy scalar: store its .item())" if type(value).__module__ == "numpy" else ""
    raise TypeError(
        f"{name!r} holds a {type(value).__name__}{hint}, which is neither Stateful (state_dict/"
        f"load_state_dict) nor a plain value (int, float, str, bool, None, tensor, dict/list)."
    )


def restore_value(saved: Any, live: Any) -> Any:
    """Puts a committed plain value back, into the live object wherever it can: a tensor of
    the same shape and dtype is copied into (a module or optimizer that holds it sees the
    rollback), a live dict or list is cleared and refilled (a ``Counter`` or ``defaultdict``
    stays one, though a commit holds plain dicts), a tuple is rebuilt as the committed one's
    kind or, off the wire (plain tuples), as the live namedtuple's. The rest comes back as
    a new copy, on the live tensor's device; the commit is never aliased."""
    if isinstance(saved, torch.Tensor):
        if isinstance(live, torch.Tensor) and live.shape == saved.shape \
                and live.dtype == saved.dtype and not live.is_inference():
            with torch.no_grad():
                live.copy_(saved)
            return live
        device = live.device if isinstance(live, torch.Tensor) else torch.device("cpu")
        return saved.to(device, copy=True)
    if isinstance(saved, Mapping):
        live_map = live if isinstance(live, Mapping) else {}
        items = {k: restore_value(v, live_map.get(k)) for k, v in saved.items()}
        if isinstance(live, dict):
            live.clear()
            live.update(items)
            return live
        return rebuild_mapping(saved, items)
    if isinstance(saved, (list, tuple)):
        same = isinstance(live, (list, tuple)) and len(live) == len(saved)
        lives = live if same else [None] * len(saved)
        items = [restore_value(v, lv) for v, lv in zip(saved, lives)]
        if isinstance(saved, list) and isinstance(live, list):
            live[:] = items
            return live
        if type(saved) is tuple and same and hasattr(live, "_fields"):
            return type(live)(*items)
        return rebuild_sequence(saved, items)
    return snapshot(saved)
