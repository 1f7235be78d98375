"""The skeleton's wire form: a payload's structure as tagged JSON, decoded without running code.

``state.feed`` sends a committed payload as this skeleton plus its tensors (alone or in buckets).
What a peer sends is data, never code: the skeleton is JSON, and decoding it builds only the
types below, checking every node. Every node is a JSON null, boolean, integer, finite number or
string, or a list whose first item is a tag:

=========================================  ================================================
``["l", item, ...]``                       list
``["t", item, ...]``                       tuple (a namedtuple arrives as a plain tuple)
``["d", [key, value], ...]``               dict (and any other mapping)
``["o", metadata, [key, value], ...]``     OrderedDict, with ``nn.Module``'s ``_metadata``
``["b", "<base64>"]``                      bytes
``["f", "nan" | "inf" | "-inf"]``          a float that JSON cannot hold
``["c", real, imag]``                      complex
``["s", index, [dim, ...], "float32"]``    a tensor: its slot in the buckets that follow
``["y", "float32"]``                       a torch.dtype
``["v", "cuda:0"]``                        a torch.device
=========================================  ================================================

Anything else in a committed state (a numpy scalar, an object of the user's) is refused on the
sending rank with the path to it. Must not import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations

import base64
import functools
import json
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic.state.errors import PayloadFormatError, SyncError

__all__ = ["TensorSlot", "encode", "decode", "MAX_DEPTH", "MAX_DIMS"]

MAX_DEPTH = 64  # nesting of a skeleton; a real state dict is a handful of levels deep
MAX_DIMS = 64  # dimensions of one tensor
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_SUPPORTED = ("int, float, complex, str, bytes, bool, None, tensors, torch.dtype, torch.device, "
              "and dicts, lists and tuples of them")


@dataclass(frozen=True)
class TensorSlot:
    """Placeholder for a tensor in a skeleton: its position in the tensor list and its form."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies when contiguous."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


class _Unencodable(Exception):
    """A leaf that has no wire form; carries the path to it, built while unwinding."""

    def __init__(self, leaf: Any) -> None:
        super().__init__(type(leaf))
        self.kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
        self.path: list[str] = []


def encode(payload: Any, tensors: list[torch.Tensor]) -> bytes:
    """The wire form of ``payload``, its tensors appended to ``tensors`` in slot order.

    Raises:
        SyncError: ``payload`` holds a value with no wire form, or is nested too deeply.
    """
    try:
        tree = _encode(payload, tensors, 0)
    except _Unencodable as exc:
        where = ".".join(reversed(exc.path)) or "<the payload>"
        raise SyncError(f"the committed state at {where} is a {exc.kind}, which state sync does "
                        f"not send: make state_dict() return {_SUPPORTED}.") from None
    return json.dumps(tree, separators=(",", ":"), allow_nan=False).encode()


def _encode(node: Any, tensors: list[torch.Tensor], depth: int) -> Any:
    kind = type(node)
    if kind is str or kind is int:  # the common leaves first: keys, counters
        return node
    if node is None or isinstance(node, bool):
        return node
    if isinstance(node, str):
        return str(node)
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node) if math.isfinite(node) else ["f", repr(float(node))]
    if isinstance(node, torch.Tensor):
        tensors.append(node)
        return ["s", len(tensors) - 1, list(node.shape), _dtype_name(node.dtype)]
    if depth >= MAX_DEPTH:
        raise SyncError(f"the committed state is nested deeper than {MAX_DEPTH} levels; state "
                        f"sync sends flatter state dicts only.")
    if isinstance(node, Mapping):
        return _encode_mapping(node, tensors, depth + 1)
    if isinstance(node, (list, tuple)):
        tag = "l" if isinstance(node, list) else "t"
        return [tag, *_encode_items(enumerate(node), tensors, depth + 1)]
    return _encode_other(node)


def _encode_mapping(node: Mapping, tensors: list[torch.Tensor], depth: int) -> list:
    body = []
    for key, value in node.items():
        try:
            body.append([_encode_key(key), _encode(value, tensors, depth)])
        except _Unencodable as exc:
            exc.path.append(str(key))
            raise
    if not isinstance(node, OrderedDict):
        return ["d", *body]
    metadata = getattr(node, "_metadata", None)
    try:
        head = None if metadata is None else _encode_tensorless(metadata, depth)
    except _Unencodable as exc:
        exc.path.append("_metadata")
        raise
    return ["o", head, *body]


def _encode_items(items: Any, tensors: list[torch.Tensor], depth: int) -> list:
    encoded = []
    for key, value in items:
        try:
            encoded.append(_encode(value, tensors, depth))
        except _Unencodable as exc:
            exc.path.append(str(key))
            raise
    return encoded


def _encode_key(key: Any) -> Any:
    if type(key) is str or type(key) is int:
        return key
    if isinstance(key, (list, dict)):
        raise _Unencodable(key)
    return _encode_tensorless(key, 0)


def _encode_tensorless(node: Any, depth: int) -> Any:
    """A node that must hold no tensor (a key, ``_metadata``): its slots would go nowhere."""
    found: list[torch.Tensor] = []
    encoded = _encode(node, found, depth)
    if found:
        raise _Unencodable(found[0])
    return encoded


def _encode_other(node: Any) -> list:
    if isinstance(node, bytes):
        return ["b", base64.b64encode(node).decode("ascii")]
    if isinstance(node, complex):
        return ["c", _encode(node.real, [], 0), _encode(node.imag, [], 0)]  # floats
    if isinstance(node, torch.dtype):
        return ["y", _dtype_name(node)]
    if isinstance(node, torch.device):
        return ["v", str(node)]
    raise _Unencodable(node)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    """Every dtype torch has, by the name the wire uses."""
    found = (getattr(torch, name) for name in dir(torch))
    return {_dtype_name(d): d for d in found if isinstance(d, torch.dtype)}


def decode(data: bytes) -> Any:
    """Rebuilds a skeleton (tensors as ``TensorSlot``) from its wire form, running no code.

    Raises:
        PayloadFormatError: ``data`` is not a skeleton this module wrote: not UTF-8 JSON, a
            node of no known form, slots out of order, an unknown dtype, a negative size...
    """
    try:
        tree = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
        slots: list[TensorSlot] = []
        return _decode(tree, slots, 0)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadFormatError(f"the state skeleton is not JSON ({exc}).") from None
    except (ValueError, TypeError, KeyError, IndexError, RecursionError,
            OverflowError, RuntimeError) as exc:
        raise PayloadFormatError(f"the state skeleton is malformed: {exc}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"the non-standard JSON constant {name} is not a wire form")


def _decode(node: Any, slots: list[TensorSlot], depth: int) -> Any:
    if type(node) is not list:  # JSON gives str, int, float, bool, None, list or dict
        if type(node) is dict:
            raise ValueError(f"a node is a JSON object, which is no wire form: {_show(node)}")
        return node
    if not node or type(node[0]) is not str:
        raise ValueError(f"a node is neither a JSON scalar nor a tagged list: {_show(node)}")
    if depth >= MAX_DEPTH:
        raise ValueError(f"the skeleton is nested deeper than {MAX_DEPTH} levels")
    tag, body = node[0], node[1:]
    if tag in ("l", "t"):
        items = [_decode(item, slots, depth + 1) for item in body]
        return items if tag == "l" else tuple(items)
    if tag == "d":
        return _decode_pairs(dict(), body, slots, depth)
    if tag == "o":
        _arity(node, minimum=2)
        out: Any = _decode_pairs(OrderedDict(), body[1:], slots, depth)
        if body[0] is not None:
            out._metadata = _decode_tensorless(body[0], depth + 1)
        return out
    if tag == "s":
        slot = _decode_slot(node, len(slots))
        slots.append(slot)
        return slot
    return _decode_leaf(node)


def _decode_pairs(out: dict, pairs: list, slots: list[TensorSlot], depth: int) -> dict:
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"a mapping entry is not a [key, value] pair: {_show(pair)}")
        key = pair[0]
        if type(key) is not str:
            key = _decode_tensorless(key, depth + 1)
        if isinstance(key, (list, dict)):
            raise ValueError(f"a mapping key is a {type(key).__name__}")
        out[key] = _decode(pair[1], slots, depth + 1)
    return out


def _decode_tensorless(node: Any, depth: int) -> Any:
    found: list[TensorSlot] = []
    decoded = _decode(node, found, depth)
    if found:
        raise ValueError("a mapping key or module metadata holds a tensor slot")
    return decoded


def _decode_slot(node: list, expected: int) -> TensorSlot:
    _arity(node, exactly=4)
    _, index, shape, dtype_name = node
    if type(index) is not int or index != expected:
        raise ValueError(f"tensor slot {_show(index)} is out of order (expected {expected})")
    if type(shape) is not list or len(shape) > MAX_DIMS:
        raise ValueError(f"tensor slot {index} has an invalid shape {_show(shape)}")
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise ValueError(f"tensor slot {index} has an invalid shape {_show(shape)}")
    dtype = _dtypes().get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ValueError(f"tensor slot {index} has an unknown dtype {_show(dtype_name)}")
    return TensorSlot(index, tuple(shape), dtype)


def _decode_leaf(node: list) -> Any:
    tag = node[0]
    if tag == "b":
        _arity(node, exactly=2)
        return base64.b64decode(_text(node[1]), validate=True)
    if tag == "f":
        _arity(node, exactly=2)
        return _NON_FINITE[_text(node[1])]
    if tag == "c":
        _arity(node, exactly=3)
        real, imag = (_decode_tensorless(part, 0) for part in node[1:])
        if not all(isinstance(part, (int, float)) and not isinstance(part, bool)
                   for part in (real, imag)):
            raise ValueError(f"a complex number has parts {_show(node[1:])}")
        return complex(real, imag)
    if tag == "y":
        _arity(node, exactly=2)
        dtype = _dtypes().get(_text(node[1]))
        if dtype is None:
            raise ValueError(f"unknown dtype {_show(node[1])}")
        return dtype
    if tag == "v":
        _arity(node, exactly=2)
        return torch.device(_text(node[1]))
    raise ValueError(f"unknown tag {_show(tag)}")


def _arity(node: list, *, exactly: int | None = None, minimum: int = 0) -> None:
    if (exactly is not None and len(node) != exactly) or len(node) < minimum:
        raise ValueError(f"a {_show(node[0])} node has {len(node)} items: {_show(node)}")


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    """A short rendering of hostile input for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
