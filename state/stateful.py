"""The ``Stateful`` protocol and the one snapshot path to host memory.

Owns how a (nested dict/list/tuple) state dict is copied to CPU: tensors are detached and
copied, reusing the buffers of the previous snapshot when structure, shape and dtype match,
so frequent commits do not allocate. Must not import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Stateful", "is_stateful", "snapshot", "rebuild_mapping", "rebuild_sequence"]

_IMMUTABLE = frozenset({int, float, complex, bool, str, bytes, type(None)})


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

    Tensors are detached and copied to CPU. Where ``previous`` (an earlier snapshot) holds
    a CPU tensor at the same position with the same shape and dtype, the data is copied
    into that buffer instead of allocating a new one; so ``previous`` must be owned by the
    caller and is overwritten. Mappings, lists and tuples are rebuilt; immutable leaves (numbers,
    strings, bytes, None) are shared; other leaves are deep-copied.

    Args:
        tree: The state to copy (a tensor, mapping, list, tuple or other leaf).
        previous: An earlier snapshot whose tensor buffers may be reused, or None.

    Returns:
        The copy, sharing no mutable object with ``tree``.
    """
    kind = type(tree)
    if kind in _IMMUTABLE:  # an optimizer's hyper-parameters, a sampler's counters
        return tree
    if kind is torch.Tensor or isinstance(tree, torch.Tensor):
        return _snapshot_tensor(tree, previous)
    if kind is dict or kind is OrderedDict or isinstance(tree, Mapping):
        prev = previous if isinstance(previous, Mapping) else {}
        return rebuild_mapping(tree, {k: snapshot(v, prev.get(k)) for k, v in tree.items()})
    if isinstance(tree, (list, tuple)):
        same = isinstance(previous, (list, tuple)) and len(previous) == len(tree)
        prev = previous if same else [None] * len(tree)
        return rebuild_sequence(tree, [snapshot(v, p) for v, p in zip(tree, prev)])
    return copy.deepcopy(tree)


def _snapshot_tensor(tensor: torch.Tensor, previous: Any) -> torch.Tensor:
    """Copies one tensor to CPU, into ``previous`` when it fits."""
    src = tensor.detach()
    if (
        isinstance(previous, torch.Tensor)
        and previous.is_cpu
        and previous.shape == src.shape
        and previous.dtype == src.dtype
        and previous.layout == src.layout == torch.strided
    ):
        return previous.copy_(src)
    if src.layout != torch.strided:
        return src.to("cpu", copy=True)
    return torch.empty_like(src, device="cpu").copy_(src)
