"""Moving a committed payload, point to point, from its source to the ranks that lack it.

Owns the wire of ``TrainState.sync``: the source sends a skeleton (the payload with every
tensor replaced by a slot, in the JSON form of ``state.wire``, which decodes without running
code) as its length and its bytes, then the tensors: each large one straight from its own
memory, the small ones packed in dtype-homogeneous buckets. The receivers form a chain behind
the source (source -> first receiver -> second ...), each forwarding every piece to the next
as it arrives, so the source's link carries the state once however many receive it, and a
rank outside the chain (one that holds that very commit already) takes no part at all.
Receivers rebuild the payload from the skeleton alone; on a CPU transport a large tensor lands
straight in the receiver's own tensor at its path when it names one (memory touched already,
where a new page costs a fault), the rest in new memory. Knows collectives, never etcd; must
not import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from elastic.state.errors import PayloadFormatError, SyncError
from elastic.state.sync import (collect_slots, fill_tensors, landing_tensors, plan_buckets,
                                transport_device)
from elastic.state.wire import TensorSlot, decode, encode

__all__ = ["Packing", "Fed", "feed_payload", "MAX_SKELETON_BYTES", "LENGTH_TAG", "SKELETON_TAG"]

MAX_SKELETON_BYTES = 1024 * 1024 * 1024  # a skeleton costs ~60 bytes a tensor
#: Bytes a CUDA transport stages on the device at once (sent or received, not yet finished);
#: on CPU nothing is staged, and every piece is on its way at once.
DEVICE_WINDOW_BYTES = 256 * 1024 * 1024
LENGTH_TAG = 0
SKELETON_TAG = 1
_FIRST_PIECE_TAG = 2
_UNSENDABLE = b"(the source's state has a value with no wire form)"  # announced as length -1


@dataclass(frozen=True)
class Packing:
    """How the tensors travel.

    Attributes:
        direct_bytes: a tensor of at least this many bytes travels alone, from its own memory.
        cap_bytes: the smaller ones are packed in dtype-homogeneous buckets of at most this.
    """

    direct_bytes: int = 1024 * 1024
    cap_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True)
class Fed:
    """What one rank got from ``feed_payload``.

    Attributes:
        payload: the source's payload (tensors on CPU) on the source and the receivers; None
            on a rank outside the chain, or everywhere when the source had none.
        nbytes: bytes this rank sent or received (skeleton and tensors); 0 outside the chain.
    """

    payload: Any
    nbytes: int


@dataclass(frozen=True)
class _Link:
    """This rank's place in the chain: global ranks of its neighbours, and the transport."""

    upstream: int | None
    downstream: int | None
    group: dist.ProcessGroup | None
    device: torch.device
    timeout: datetime.timedelta | None


@dataclass
class _Piece:
    """One message of the tensors: a single tensor, or a bucket of packed small ones."""

    slots: list[TensorSlot]
    landing: torch.Tensor | None = None  # the receiver's own tensor that takes it in place
    wire: torch.Tensor | None = None
    work: Any = None
    forwards: list[Any] = field(default_factory=list)


def feed_payload(payload: Any, src: int, receivers: list[int] | tuple[int, ...] | None = None,
                 group: dist.ProcessGroup | None = None, *,
                 timeout: datetime.timedelta | None = None, packing: Packing = Packing(),
                 into: Any = None) -> Fed:
    """Sends ``payload`` from group rank ``src`` to the group ranks ``receivers``.

    The source and every receiver must call it with the same ``src`` and ``receivers``; a rank
    that is neither returns at once (calling it there is allowed, so every rank can run the
    same code). Tensors travel on CPU for gloo and on the current CUDA device for NCCL, and
    are returned on CPU.

    Args:
        payload: the source's payload (None when it has none, which the receivers then
            return); ignored on the other ranks.
        src: the source's rank within ``group``.
        receivers: ranks within ``group`` that need the payload; None means every other rank.
        group: the process group; None means the default group.
        timeout: bound on each message; None waits for the group's own timeout.
        packing: which tensors travel alone and how the others are packed.
        into: on a receiver, a tree shaped like the payload holding its own tensors: a tensor
            that travels alone is received straight into the one at its path when that fits
            (``landing_tensors``; CPU transports only), and the returned payload holds it;
            written even when the transfer then fails. Ignored on the source.

    Returns:
        The payload and the bytes this rank moved.

    Raises:
        SyncError: a message failed or timed out, or the source's state holds a value that
            has no wire form (see ``state.wire``; raised on the source and every receiver).
        PayloadFormatError: the source sent something that is not a payload (malformed or
            hostile); nothing of it ran.
    """
    me = dist.get_rank(group)
    if receivers is None:
        receivers = [r for r in range(dist.get_world_size(group)) if r != src]
    chain = [src] + sorted(set(receivers) - {src})
    if me not in chain or len(chain) == 1:
        return Fed(payload if me == src else None, 0)
    at = chain.index(me)
    link = _Link(_global(group, chain[at - 1]) if at else None,
                 _global(group, chain[at + 1]) if at + 1 < len(chain) else None,
                 group, transport_device(group), timeout)
    tensors: list[torch.Tensor] = []
    refusal: SyncError | None = None
    wire: bytes | None = None
    if me == src:
        try:
            wire = encode(payload, tensors) if payload is not None else b""
        except SyncError as exc:  # the receivers are waiting: they hear of it before it is raised
            refusal, wire = exc, _UNSENDABLE
    data = _pass_skeleton(wire, link, _global(group, src))
    if refusal is not None:
        raise refusal
    if not data:
        return Fed(None, 8)
    try:
        skeleton = decode(data)
    except PayloadFormatError as exc:
        raise PayloadFormatError(f"rank {src} sent a state skeleton that is not one: "
                                 f"{exc}") from None
    got, nbytes = _pass_tensors(skeleton, tensors if me == src else None, link, packing,
                                None if me == src else into)
    return Fed(payload if me == src else got, 8 + len(data) + nbytes)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _pass_skeleton(data: bytes | None, link: _Link, global_src: int) -> bytes:
    """Sends (source) or receives and forwards the skeleton: its length, then its bytes.

    A receiver forwards before it looks at what came, so that every receiver judges the same
    bytes and raises the same error.

    Raises:
        SyncError: a message failed, or the source could not encode its state.
        PayloadFormatError: the announced length is negative or larger than
            ``MAX_SKELETON_BYTES``.
    """
    announced = -1 if data is _UNSENDABLE else len(data) if data is not None else 0
    size = torch.tensor([announced], dtype=torch.int64, device=link.device)
    _relay(size, link, LENGTH_TAG, "the state skeleton's length")
    length = int(size.item())
    if data is _UNSENDABLE:
        return data  # the source raises its own error, which names the value
    if length == -1:
        raise SyncError(f"global rank {global_src} could not encode its committed state; its own "
                        f"error says which value of which object to change.")
    if not 0 <= length <= MAX_SKELETON_BYTES:
        raise PayloadFormatError(f"global rank {global_src} announced a state skeleton of "
                                 f"{length} bytes (at most {MAX_SKELETON_BYTES}).")
    if not length:
        return b""
    if data is not None:
        wire = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(link.device)
    else:
        wire = torch.empty(length, dtype=torch.uint8, device=link.device)
    _relay(wire, link, SKELETON_TAG, "the state skeleton")
    return data if data is not None else wire.cpu().numpy().tobytes()


def _relay(tensor: torch.Tensor, link: _Link, tag: int, what: str) -> None:
    """Receives ``tensor`` from upstream (unless the source), then sends it downstream."""
    if link.upstream is not None:
        _wait(_post(dist.irecv, tensor, link.upstream, link, tag, what), link, what)
    if link.downstream is not None:
        _wait(_post(dist.isend, tensor, link.downstream, link, tag, what), link, what)


def _post(op: Any, tensor: torch.Tensor, peer: int, link: _Link, tag: int, what: str) -> Any:
    try:
        return op(tensor, peer, group=link.group, tag=tag)
    except RuntimeError as exc:
        raise SyncError(f"moving {what} ({tensor.numel() * tensor.element_size()} bytes) "
                        f"with global rank {peer} failed: {exc}") from exc


def _wait(work: Any, link: _Link, what: str) -> None:
    try:
        completed = work.wait() if link.timeout is None else work.wait(link.timeout)
    except RuntimeError as exc:
        raise SyncError(f"moving {what} failed or timed out after {link.timeout}: "
                        f"{exc}") from exc
    if completed is False:
        raise SyncError(f"moving {what} did not complete within {link.timeout}.")


def plan_pieces(slots: list[TensorSlot], packing: Packing) -> list[list[TensorSlot]]:
    """The messages the tensors travel in: each large tensor alone, then the small ones in
    dtype buckets (``plan_buckets``). Depends only on the slots: every rank plans the same."""
    large = [[s] for s in sorted(slots, key=lambda s: s.index)
             if s.nbytes and s.nbytes >= packing.direct_bytes]
    small = [s for s in slots if 0 < s.nbytes < packing.direct_bytes]
    return large + plan_buckets(small, packing.cap_bytes)


def _pass_tensors(skeleton: Any, sources: list[torch.Tensor] | None, link: _Link,
                  packing: Packing, into: Any) -> tuple[Any, int]:
    """Sends (source) or receives and forwards the skeleton's tensors; returns the received
    payload (None on the source) and the bytes of tensors moved."""
    slots: list[TensorSlot] = []
    collect_slots(skeleton, slots)
    received: list[torch.Tensor | None] = [None] * len(slots)
    for slot in slots:
        if not slot.nbytes:
            received[slot.index] = torch.empty(slot.shape, dtype=slot.dtype)
    pieces = [_Piece(s) for s in plan_pieces(slots, packing)]
    if into is not None and link.device.type == "cpu":
        landing = landing_tensors(skeleton, into, link.device)
        for piece in pieces:
            if len(piece.slots) == 1:
                piece.landing = landing.get(piece.slots[0].index)
    window = DEVICE_WINDOW_BYTES if link.device.type != "cpu" else None
    posted = done = staged = 0
    while done < len(pieces):
        while posted < len(pieces) and (window is None or staged < window or posted == done):
            staged += _start(pieces[posted], posted, sources, link)
            posted += 1
        staged -= _finish(pieces[done], done, received, link)
        done += 1
    for piece in pieces:
        for work in piece.forwards:
            _wait(work, link, f"state piece of {_nbytes(piece.slots)} bytes")
    moved = sum(_nbytes(p.slots) for p in pieces)
    return (None if sources is not None else fill_tensors(skeleton, received)), moved


def _nbytes(slots: list[TensorSlot]) -> int:
    return sum(slot.nbytes for slot in slots)


def _start(piece: _Piece, number: int, sources: list[torch.Tensor] | None, link: _Link) -> int:
    """Posts one piece's send (source) or receive; returns the bytes it stages."""
    nbytes = _nbytes(piece.slots)
    what = f"a state piece of {nbytes} bytes"
    if sources is not None:
        tensors = [sources[s.index].detach().to(link.device).contiguous().reshape(-1)
                   for s in piece.slots]
        flat = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        piece.wire = flat.view(torch.uint8)
        piece.forwards.append(_post(dist.isend, piece.wire, link.downstream, link,
                                    _FIRST_PIECE_TAG + number, what))
        return nbytes
    if piece.landing is not None:
        piece.wire = piece.landing.reshape(-1).view(torch.uint8)
    else:
        try:
            piece.wire = torch.empty(nbytes, dtype=torch.uint8, device=link.device)
        except (RuntimeError, MemoryError) as exc:
            raise PayloadFormatError(f"global rank {link.upstream} announced a state piece of "
                                     f"{nbytes} bytes, which this worker cannot allocate: "
                                     f"{exc}") from exc
    piece.work = _post(dist.irecv, piece.wire, link.upstream, link, _FIRST_PIECE_TAG + number,
                       what)
    return nbytes


def _finish(piece: _Piece, number: int, received: list[torch.Tensor | None],
            link: _Link) -> int:
    """Waits for one piece, forwards it downstream and unpacks it into ``received`` (CPU);
    returns the bytes it staged."""
    assert piece.wire is not None
    nbytes = _nbytes(piece.slots)
    if piece.work is None:  # the source: its sends are waited for at the end
        return nbytes if link.device.type == "cpu" else _drain(piece, link, nbytes)
    _wait(piece.work, link, f"a state piece of {nbytes} bytes from global rank {link.upstream}")
    if link.downstream is not None:
        piece.forwards.append(_post(dist.isend, piece.wire, link.downstream, link,
                                    _FIRST_PIECE_TAG + number, f"a state piece of {nbytes} bytes"))
        if link.device.type != "cpu":
            _drain(piece, link, nbytes)
    if piece.landing is not None:  # received in place (CPU only): nothing to unpack
        received[piece.slots[0].index] = piece.landing
        return nbytes
    values = piece.wire.cpu().view(piece.slots[0].dtype)
    sizes = [slot.nbytes // slot.dtype.itemsize for slot in piece.slots]
    for slot, part in zip(piece.slots, torch.split(values, sizes)):
        received[slot.index] = part.view(slot.shape)
    if link.device.type != "cpu":
        piece.wire = None  # the staging on the device is copied out and forwarded
    return nbytes


def _drain(piece: _Piece, link: _Link, nbytes: int) -> int:
    """Waits for a piece's sends so that its device staging can be freed."""
    for work in piece.forwards:
        _wait(work, link, f"a state piece of {nbytes} bytes")
    piece.forwards.clear()
    return nbytes
