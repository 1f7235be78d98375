"""The ``Stateful`` protocol and the one snapshot path to host memory.

Owns how a (nested dict/list/tuple) state dict is copied to CPU: tensors are detached and
copied, reusing the previous snapshot when structure, shape and dtype match (its containers are
updated in place and its tensors copied into with one batched copy), so frequent commits
neither allocate nor rebuild. Must not import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from elastic.state.device_copy import copy_to_host, host_buffer

__all__ = ["Stateful", "is_stateful", "snapshot", "rebuild_mapping", "rebuild_sequence", "LIVE"]


class _Live:
    """The marker of a tensor left live in a copy-free commit (``state.live_commit``): one
    instance, which every snapshot and copy shares like an immutable leaf."""

    def __repr__(self) -> str:
        return "LIVE"

    def __copy__(self) -> "_Live":
        return self

    def __deepcopy__(self, memo: dict) -> "_Live":
        return self


LIVE = _Live()
_IMMUTABLE = frozenset({int, float, complex, bool, str, bytes, type(None), _Live})


@runtime_checkable
class Stateful(Protocol):
    """An object whose state can be saved and loaded as a state dict.

    ``nn.Module``, ``torch.optim.Optimizer``, LR schedulers, ``GradScaler`` and
    ``ElasticSampler`` already satisfy it.
    """

    def state_dict(self) -> dict[str, Any]:
        """Returns the object's state as a (nested) dict."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        """Replaces the object's state with ``state_dict``."""


def is_stateful(obj: Any) -> bool:
    """Returns whether ``obj`` has callable ``state_dict`` and ``load_state_dict``.

    Classes themselves (not instances) are not Stateful, although they carry the methods.
    """
    return not isinstance(obj, type) and isinstance(obj, Stateful)


def rebuild_mapping(src: Mapping, items: dict) -> dict:
    """Builds a mapping of the same kind as ``src`` holding ``items``.

    ``OrderedDict`` stays an ``OrderedDict`` and keeps the ``_metadata`` attribute that
    ``nn.Module.state_dict`` uses for per-module versions; other mappings become ``dict``.

    Args:
        src: The mapping whose kind (and ``_metadata``) to copy.
        items: The new key/value pairs, in order.

    Returns:
        The new mapping.
    """
    out: dict = OrderedDict(items) if isinstance(src, OrderedDict) else dict(items)
    metadata = getattr(src, "_metadata", None)
    if metadata is not None:
        out._metadata = _copy_metadata(metadata)  # type: ignore[attr-defined]
    return out


def _copy_metadata(metadata: Any) -> Any:
    """Copies ``nn.Module`` state-dict metadata (``{prefix: {"version": int}}``) cheaply."""
    plain = type(metadata) in (dict, OrderedDict) and all(
        type(entry) is dict and all(type(x) in _IMMUTABLE for x in entry.values())
        for entry in metadata.values())
    if not plain:
        return copy.deepcopy(metadata)
    return type(metadata)((prefix, dict(entry)) for prefix, entry in metadata.items())


def rebuild_sequence(src: list | tuple, items: list) -> list | tuple:
    """Builds a list, tuple or namedtuple of the same kind as ``src`` holding ``items``.

    Args:
        src: The sequence whose kind to copy.
        items: The new elements.

    Returns:
        The new sequence.
    """
    if isinstance(src, list):
        return items
    if hasattr(src, "_fields"):  # namedtuple
        return type(src)(*items)
    return tuple(items)


def snapshot(tree: Any, previous: Any = None) -> Any:
    """Deep-copies a nested state to CPU host memory.

    Tensors are detached and copied to CPU; immutable leaves (numbers, strings, bytes, None)
    are shared; other leaves are deep-copied. ``previous`` (an earlier snapshot, owned by the
    caller) is overwritten: when it has the structure of ``tree`` (same container types and
    keys, CPU tensors of the same shape and dtype, equal tuple items) it is updated in place
    and returned, its tensors filled by one batched copy; otherwise mappings, lists and tuples
    are rebuilt, still copying into ``previous``'s tensors wherever they fit.

    Args:
        tree: The state to copy (a tensor, mapping, list, tuple or other leaf).
        previous: An earlier snapshot to overwrite, or None.

    Returns:
        The copy, sharing no mutable object with ``tree``.
    """
    if previous is not None and type(tree) not in _IMMUTABLE:
        copies = _Copies()
        if _refresh(tree, previous, copies):
            copies.run()
            return previous
    return _rebuild(tree, previous)


def _rebuild(tree: Any, previous: Any) -> Any:
    """Builds a new snapshot of ``tree``, copying into ``previous``'s tensors where they fit."""
    kind = type(tree)
    if kind in _IMMUTABLE:  # an optimizer's hyper-parameters, a sampler's counters
        return tree
    if kind is torch.Tensor or isinstance(tree, torch.Tensor):
        return _snapshot_tensor(tree, previous)
    if kind is dict or kind is OrderedDict or isinstance(tree, Mapping):
        prev = previous if isinstance(previous, Mapping) else {}
        return rebuild_mapping(tree, {k: _rebuild(v, prev.get(k)) for k, v in tree.items()})
    if isinstance(tree, (list, tuple)):
        same = isinstance(previous, (list, tuple)) and len(previous) == len(tree)
        prev = previous if same else [None] * len(tree)
        return rebuild_sequence(tree, [_rebuild(v, p) for v, p in zip(tree, prev)])
    return copy.deepcopy(tree)


def _fits(buffer: Any, src: torch.Tensor) -> bool:
    """Whether ``src`` can be copied into ``buffer`` (a strided CPU tensor of its shape and dtype)."""
    return (
        isinstance(buffer, torch.Tensor)
        and buffer.is_cpu
        and buffer.shape == src.shape
        and buffer.dtype == src.dtype
        and buffer.layout == src.layout == torch.strided
    )


def _snapshot_tensor(tensor: torch.Tensor, previous: Any) -> torch.Tensor:
    """Copies one tensor to CPU, into ``previous`` when it fits (a GPU tensor's new buffer is
    pinned, so that later commits copy into it asynchronously: ``device_copy``)."""
    src = tensor.detach()
    if _fits(previous, src):
        return previous.copy_(src)
    if src.layout != torch.strided:
        return src.to("cpu", copy=True)
    return host_buffer(src).copy_(src)


class _Copies:
    """The tensor copies of one in-place refresh, run together at the end.

    Sources on the CPU go in one ``torch._foreach_copy_`` (one call instead of one per
    tensor); sources on a GPU are copied without blocking on a side stream, and waited for once
    (``device_copy.copy_to_host``). A refresh that fails half-way drops them unrun.
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []

    def add(self, buffer: torch.Tensor, src: torch.Tensor) -> None:
        self.buffers.append(buffer)
        self.sources.append(src)

    def run(self) -> None:
        if not self.buffers:
            return
        pairs = list(zip(self.buffers, self.sources))
        on_host = [(b, s) for b, s in pairs if s.is_cpu]
        on_devices = [(b, s) for b, s in pairs if not s.is_cpu]
        with torch.no_grad():
            if on_host:
                torch._foreach_copy_([b for b, _ in on_host], [s for _, s in on_host])
            if on_devices:
                copy_to_host(on_devices)


def _refresh(tree: Any, previous: Any, copies: _Copies) -> bool:
    """Makes ``previous`` a snapshot of ``tree`` in place, its tensor copies left in ``copies``.

    Returns False when the structures differ; ``previous`` is then still a valid snapshot of
    something (only whole entries of it were replaced) and serves as a source of buffers.
    """
    if isinstance(tree, torch.Tensor):
        if not _fits(previous, tree) or type(previous) is not torch.Tensor:
            return False
        copies.add(previous, tree)
        return True
    kind = type(tree)
    if kind is not type(previous):
        return False
    if kind is dict or kind is OrderedDict:
        if len(tree) != len(previous) or getattr(tree, "_metadata", None) != getattr(
                previous, "_metadata", None):
            return False
        for (key, value), old_key in zip(tree.items(), previous):
            if key != old_key:
                return False
            _refresh_item(previous, key, value, copies)
        return True
    if kind is list:
        if len(tree) != len(previous):
            return False
        for i, value in enumerate(tree):
            _refresh_item(previous, i, value, copies)
        return True
    if kind is tuple:  # immutable: usable only when its immutable items are equal
        return len(tree) == len(previous) and all(
            (type(v) in _IMMUTABLE and type(v) is type(p) and v == p)
            or (type(v) not in _IMMUTABLE and _refresh(v, p, copies))
            for v, p in zip(tree, previous))
    return False


def _refresh_item(previous: dict | list, index: Any, value: Any, copies: _Copies) -> None:
    """Makes ``previous[index]`` a snapshot of ``value``: in place, else rebuilt on its own."""
    if type(value) in _IMMUTABLE:
        previous[index] = value
        return
    if not _refresh(value, previous[index], copies):
        # Copies the sub-tree queued before it failed target the buffers that this rebuild
        # fills from the same sources, so they may stay queued.
        previous[index] = _rebuild(value, previous[index])
