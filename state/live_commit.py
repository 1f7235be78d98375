"""The copy-free commit's record: every registered object except the tensors the step owns.

Owns which tensors stay live in a copy-free commit (the parameters of the registered optimizers
and their per-parameter state: exactly what ``optimizer.step()`` writes), the record of
everything else (a snapshot in which each live tensor is a ``LIVE`` marker), and putting the
live tensors back into a record to restore or send it. The live state is the rollback point
itself only because the run loop applies the step on every rank or on none (the agreement of
``ElasticState.commit_step``); this module knows nothing of that, nor of ``elastic`` or
``checkpoint``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from elastic.state.errors import StateError, StateKeyError
from elastic.state.stateful import LIVE, rebuild_mapping, rebuild_sequence, snapshot

__all__ = ["LIVE", "is_optimizer", "live_tensor_addresses", "mark_live", "fill_live",
           "holds_live", "require_optimizers"]


def is_optimizer(obj: Any) -> bool:
    """Whether ``obj`` looks like a torch optimizer (``param_groups`` and a ``state`` mapping)."""
    return isinstance(getattr(obj, "param_groups", None), list) and isinstance(
        getattr(obj, "state", None), Mapping)


def live_tensor_addresses(optimizers: Iterable[Any]) -> set[int]:
    """The data addresses of every tensor an optimizer step writes: parameters and their state.

    Args:
        optimizers: torch optimizers (see ``is_optimizer``).

    Returns:
        ``data_ptr()`` of each non-empty parameter and per-parameter state tensor.
    """
    addresses: set[int] = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            addresses.update(p.data_ptr() for p in group["params"] if p.numel())
        for per_param in optimizer.state.values():
            addresses.update(t.data_ptr() for t in per_param.values()
                             if isinstance(t, torch.Tensor) and t.numel())
    return addresses


def mark_live(tree: Any, live: set[int]) -> Any:
    """``tree`` with each tensor whose data lies at an address in ``live`` replaced by ``LIVE``.

    Containers are rebuilt (cheaply: no tensor is copied); ``snapshot`` of the result copies the
    rest.
    """
    if isinstance(tree, torch.Tensor):
        return LIVE if tree.numel() and tree.data_ptr() in live else tree
    if isinstance(tree, Mapping):
        return rebuild_mapping(tree, {k: mark_live(v, live) for k, v in tree.items()})
    if isinstance(tree, (list, tuple)):
        return rebuild_sequence(tree, [mark_live(v, live) for v in tree])
    return tree


def holds_live(tree: Any) -> bool:
    """Whether a record holds at least one ``LIVE`` marker."""
    if tree is LIVE:
        return True
    if isinstance(tree, Mapping):
        return any(holds_live(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(holds_live(v) for v in tree)
    return False


def fill_live(record: Any, live: Any, *, copy: bool, path: str = "") -> Any:
    """``record`` with each ``LIVE`` marker replaced by the tensor at the same place in ``live``.

    Args:
        record: a record made by ``snapshot(mark_live(...))``.
        live: the object's current ``state_dict()``.
        copy: copy the recorded (non-live) tensors and containers, so that loading the result
            into the object leaves the record untouched; live tensors are never copied.
        path: where ``record`` sits (for the error message).

    Raises:
        StateKeyError: the live state lacks a place the record marks live (the object's
            structure changed since the commit).
    """
    if record is LIVE:
        if not isinstance(live, torch.Tensor):
            raise StateKeyError(f"the copy-free commit keeps {path or 'a tensor'} live, but the "
                                f"object's state holds {type(live).__name__} there now; its "
                                f"structure changed since the commit (call commit() after "
                                f"changing an optimizer's parameters or state).")
        return live
    if isinstance(record, Mapping):
        live_map = live if isinstance(live, Mapping) else {}
        return rebuild_mapping(record, {k: fill_live(v, live_map.get(k), copy=copy,
                                                     path=f"{path}/{k}")
                                        for k, v in record.items()})
    if isinstance(record, (list, tuple)):
        same = isinstance(live, (list, tuple)) and len(live) == len(record)
        lives = live if same else [None] * len(record)
        return rebuild_sequence(record, [fill_live(v, lv, copy=copy, path=f"{path}/{i}")
                                         for i, (v, lv) in enumerate(zip(record, lives))])
    return snapshot(record) if copy else record


def require_optimizers(optimizers: list[Any]) -> None:
    """Raises StateError when no optimizer is registered (a copy-free commit needs one)."""
    if not optimizers:
        raise StateError("commit_step() keeps the tensors of the registered optimizers live, "
                         "and no optimizer is registered: register it (ElasticState(model=..., "
                         "optimizer=opt)) or use commit(), which copies everything.")
