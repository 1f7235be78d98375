"""Moving a committed payload over a torch.distributed process group, and choosing its source.

Owns the choice of the newest holder after a group forms (``newest_source``) and the wire
format of ``TrainState.sync``: a small skeleton (the payload with every tensor replaced by a
slot, in the JSON form of ``state.wire``, which decodes without running code) sent as its
length and its bytes, then the tensors in dtype-homogeneous byte buckets of bounded size.
Receivers rebuild the payload from the skeleton alone, never from their own (possibly empty)
structure. Knows collectives, never etcd; must not import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic.state.errors import PayloadFormatError, SyncError
from elastic.state.stateful import rebuild_mapping, rebuild_sequence
from elastic.state.wire import TensorSlot, decode, encode

__all__ = ["TensorSlot", "BUCKET_BYTES", "MAX_SKELETON_BYTES", "DURABLE_UNREADABLE", "Source",
           "fill_tensors", "plan_buckets", "broadcast_payload", "newest_source"]

BUCKET_BYTES = 64 * 1024 * 1024
#: Buckets in flight beyond the one being waited for (1: the next one is copied and on its way
#: while the last one travels; gloo runs a group's collectives on two threads). 0 until
#: ``python -m benchmarks joiner-feed`` on an idle machine shows 1 feeds a joiner faster.
IN_FLIGHT = 0
MAX_SKELETON_BYTES = 1024 * 1024 * 1024  # a skeleton costs ~60 bytes a tensor
#: rank 0's ``durable_version`` when its checkpoint storage could not be read.
DURABLE_UNREADABLE = -1
_UNSENDABLE = b"(the source's state has a value with no wire form)"  # announced as length -1


@dataclass(frozen=True)
class Source:
    """Where the group's state comes from after forming.

    Attributes:
        rank: the rank whose commit every rank takes.
        from_durable: True when rank 0's newest durable checkpoint is newer than every
            in-memory commit: rank 0 loads it first, then is the source.
        held_by_all: every rank holds that very commit already (the same version, made in
            the same round): nothing needs to be sent.
        version: the newest in-memory commit's version, over all ranks.
        synced_before: some rank holds state synced in an earlier group (a non-zero lineage).
        durable_unreadable: rank 0 could not read its checkpoint storage (``DURABLE_UNREADABLE``).
    """

    rank: int
    from_durable: bool
    held_by_all: bool = False
    version: int = 0
    synced_before: bool = False
    durable_unreadable: bool = False


def newest_source(version: int, durable_version: int = 0,
                  group: dist.ProcessGroup | None = None, lineage: int = 0) -> Source:
    """Chooses the holder of the newest state; every rank of ``group`` gets the same answer.

    Collective: all-gathers each rank's commit version and lineage (and rank 0's newest
    durable version). The newest in-memory commit wins, the lowest rank among equals (the last
    collective can have succeeded on one rank and failed on another, so the plan's guess is
    checked here). Ranks of one version and one non-zero lineage hold the same commit.

    Args:
        version: this rank's commit version.
        durable_version: on rank 0, the version of the newest durable checkpoint (0: none;
            ``DURABLE_UNREADABLE``: the storage could not be read); ignored on the other ranks.
        group: the process group; None means the default group.
        lineage: names the group in which this rank's commits were made since every member
            of it held the same state (a positive int64, the same on each of its ranks); 0
            when there is none (a rank that has not synced in any group yet).

    Raises:
        RuntimeError: the all-gather failed (a peer is gone).
    """
    mine = torch.tensor([version, durable_version, lineage], dtype=torch.int64,
                        device=_transport_device(group))
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    versions = [int(g[0].item()) for g in gathered]
    newest_durable = int(gathered[0][1].item())
    if newest_durable > max(versions):
        return Source(rank=0, from_durable=True)
    held = {(int(g[0].item()), int(g[2].item())) for g in gathered}
    return Source(rank=versions.index(max(versions)), from_durable=False,
                  held_by_all=len(held) == 1 and lineage != 0, version=max(versions),
                  synced_before=any(int(g[2].item()) != 0 for g in gathered),
                  durable_unreadable=newest_durable == DURABLE_UNREADABLE)


def fill_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Puts ``tensors[slot.index]`` back in place of each slot of a decoded skeleton."""
    if isinstance(skeleton, TensorSlot):
        return tensors[skeleton.index]
    if isinstance(skeleton, Mapping):
        return rebuild_mapping(skeleton, {k: fill_tensors(v, tensors) for k, v in skeleton.items()})
    if isinstance(skeleton, (list, tuple)):
        return rebuild_sequence(skeleton, [fill_tensors(v, tensors) for v in skeleton])
    return skeleton


def collect_slots(skeleton: Any, slots: list[TensorSlot]) -> None:
    """Appends every slot of ``skeleton`` to ``slots`` (in tree order)."""
    if isinstance(skeleton, TensorSlot):
        slots.append(skeleton)
    elif isinstance(skeleton, Mapping):
        for value in skeleton.values():
            collect_slots(value, slots)
    elif isinstance(skeleton, (list, tuple)):
        for value in skeleton:
            collect_slots(value, slots)


def plan_buckets(slots: list[TensorSlot], cap_bytes: int = BUCKET_BYTES) -> list[list[TensorSlot]]:
    """Groups slots by dtype into buckets of at most ``cap_bytes`` each.

    A tensor larger than the cap gets a bucket of its own. The plan depends only on the
    slot list, so every rank computes the same one. Empty tensors are left out.

    Args:
        slots: Tensor placeholders, in index order.
        cap_bytes: Largest bucket size in bytes.

    Returns:
        Buckets of slots; each bucket holds a single dtype.
    """
    by_dtype: dict[torch.dtype, list[TensorSlot]] = {}
    for slot in sorted(slots, key=lambda s: s.index):
        if slot.nbytes:
            by_dtype.setdefault(slot.dtype, []).append(slot)
    buckets: list[list[TensorSlot]] = []
    for group in by_dtype.values():
        current: list[TensorSlot] = []
        size = 0
        for slot in group:
            if current and size + slot.nbytes > cap_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(slot)
            size += slot.nbytes
        if current:
            buckets.append(current)
    return buckets


def broadcast_payload(
    payload: Any,
    src: int,
    group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta | None = None,
    cap_bytes: int = BUCKET_BYTES,
) -> Any:
    """Broadcasts ``payload`` from group rank ``src``; every rank returns the source's copy.

    Collective: all ranks of ``group`` must call it. On the source, ``payload`` is the
    committed payload (or None when there is none, which every rank then returns); on
    the others it is ignored. Tensors travel on CPU for gloo and on the current CUDA
    device for NCCL, and are returned on CPU.

    Args:
        payload: The source's payload; ignored on other ranks.
        src: The source's rank within ``group``.
        group: The process group; None means the default group.
        timeout: Bound on each bucket broadcast; None waits for the group's own timeout.
            The skeleton broadcast is bounded by the group's timeout only.
        cap_bytes: Largest bucket size in bytes.

    Returns:
        The source's payload (tensors on CPU), or None if the source had none.

    Raises:
        SyncError: A broadcast failed or timed out, or the source's state holds a value that
            has no wire form (see ``state.wire``; raised on every rank).
        PayloadFormatError: The source sent something that is not a payload (malformed or
            hostile); nothing of it ran.
    """
    is_src = dist.get_rank(group) == src
    global_src = src if group is None else dist.get_global_rank(group, src)
    device = _transport_device(group)
    tensors: list[torch.Tensor] = []
    refusal: SyncError | None = None
    wire: bytes | None = None
    if is_src:
        try:
            wire = encode(payload, tensors) if payload is not None else b""
        except SyncError as exc:  # the others are waiting: they hear of it before it is raised
            refusal, wire = exc, _UNSENDABLE
    data = _broadcast_skeleton(wire, global_src, group, device)
    if refusal is not None:
        raise refusal
    if not data:
        return None
    try:
        skeleton = decode(data)
    except PayloadFormatError as exc:
        raise PayloadFormatError(f"rank {src} sent a state skeleton that is not one: "
                                 f"{exc}") from None
    how = (global_src, group, device, timeout)
    return _broadcast_tensors(skeleton, tensors if is_src else None, how, cap_bytes)


def _broadcast_skeleton(data: bytes | None, global_src: int, group: dist.ProcessGroup | None,
                        device: torch.device) -> bytes:
    """Broadcasts the source's skeleton bytes (``data``; None on the others): length, then bytes.

    Raises:
        SyncError: a broadcast failed.
        PayloadFormatError: the announced length is negative or larger than
            ``MAX_SKELETON_BYTES``.
    """
    announced = -1 if data is _UNSENDABLE else len(data) if data is not None else 0
    size = torch.tensor([announced], dtype=torch.int64, device=device)
    try:
        dist.broadcast(size, src=global_src, group=group)
    except RuntimeError as exc:
        raise SyncError(f"broadcasting the state skeleton from global rank {global_src} failed: "
                        f"{exc}") from exc
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
        wire = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        wire = torch.empty(length, dtype=torch.uint8, device=device)
    try:
        dist.broadcast(wire, src=global_src, group=group)
    except RuntimeError as exc:
        raise SyncError(f"broadcasting the state skeleton from global rank {global_src} failed: "
                        f"{exc}") from exc
    return data if data is not None else wire.cpu().numpy().tobytes()


def _broadcast_tensors(skeleton: Any, sources: list[torch.Tensor] | None,
                       how: tuple, cap_bytes: int) -> Any:
    """Sends (source) or receives the skeleton's tensors in buckets; returns the payload."""
    slots: list[TensorSlot] = []
    collect_slots(skeleton, slots)
    received: list[torch.Tensor | None] = [None] * len(slots)
    for slot in slots:
        if not slot.nbytes:
            received[slot.index] = torch.empty(slot.shape, dtype=slot.dtype)
    in_flight: list[_Sending] = []
    for bucket in plan_buckets(slots, cap_bytes):
        in_flight.append(_start_bucket(bucket, sources, how))
        if len(in_flight) > IN_FLIGHT:  # the next bucket is copied while this one travels
            _finish_bucket(in_flight.pop(0), received, how)
    for sending in in_flight:
        _finish_bucket(sending, received, how)
    return fill_tensors(skeleton, received)


def _transport_device(group: dist.ProcessGroup | None) -> torch.device:
    """CUDA (current device) for an NCCL group, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class _Sending:
    """One bucket's broadcast in flight."""

    bucket: list[TensorSlot]
    wire: torch.Tensor
    work: Any


def _start_bucket(
    bucket: list[TensorSlot],
    sources: list[torch.Tensor] | None,
    how: tuple[int, dist.ProcessGroup | None, torch.device, datetime.timedelta | None],
) -> _Sending:
    """Starts sending (or receiving) one bucket as bytes."""
    global_src, group, device, timeout = how
    nbytes = sum(slot.nbytes for slot in bucket)
    if sources is not None:
        flat = torch.cat([sources[s.index].detach().reshape(-1) for s in bucket])
        wire = flat.view(torch.uint8).to(device)
    else:
        try:
            wire = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except (RuntimeError, MemoryError) as exc:
            raise PayloadFormatError(f"global rank {global_src} announced a bucket of {nbytes} "
                                     f"bytes, which this worker cannot allocate: {exc}") from exc
    try:
        work = dist.broadcast(wire, src=global_src, group=group, async_op=True)
    except RuntimeError as exc:
        raise SyncError(f"broadcasting a state bucket of {nbytes} bytes from global rank "
                        f"{global_src} failed: {exc}") from exc
    return _Sending(bucket, wire, work)


def _finish_bucket(
    sending: _Sending,
    received: list[torch.Tensor | None],
    how: tuple[int, dist.ProcessGroup | None, torch.device, datetime.timedelta | None],
) -> None:
    """Waits for one bucket (``timeout`` at most) and unflattens it into ``received`` (CPU)."""
    global_src, _, _, timeout = how
    bucket, wire = sending.bucket, sending.wire
    nbytes = wire.numel()
    try:
        completed = sending.work.wait() if timeout is None else sending.work.wait(timeout)
    except RuntimeError as exc:
        raise SyncError(f"broadcasting a state bucket of {nbytes} bytes from global rank "
                        f"{global_src} failed or timed out after {timeout}: {exc}") from exc
    if completed is False:
        raise SyncError(f"broadcasting a state bucket of {nbytes} bytes from global rank "
                        f"{global_src} did not complete within {timeout}.")
    values = wire.cpu().view(bucket[0].dtype)
    sizes = [slot.nbytes // slot.dtype.itemsize for slot in bucket]
    for slot, part in zip(bucket, torch.split(values, sizes)):
        received[slot.index] = part.view(slot.shape)
