"""Choosing the source of the newest state after a group forms, and who must receive it.

Owns ``newest_source`` (the holder of the newest commit, and the ranks that lack that very
commit) and the plan of a payload's tensors (slots, dtype buckets, and a receiver's own tensors
that take slots in place) that ``state.feed`` sends point to point. Knows collectives, never
etcd; must not import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic.state.stateful import rebuild_mapping, rebuild_sequence
from elastic.state.wire import TensorSlot

__all__ = ["TensorSlot", "BUCKET_BYTES", "DURABLE_UNREADABLE", "Source", "fill_tensors",
           "collect_slots", "landing_tensors", "plan_buckets", "newest_source",
           "transport_device"]

BUCKET_BYTES = 64 * 1024 * 1024
#: rank 0's ``durable_version`` when its checkpoint storage could not be read.
DURABLE_UNREADABLE = -1


@dataclass(frozen=True)
class Source:
    """Where the group's state comes from after forming.

    Attributes:
        rank: the rank whose commit every rank takes.
        from_durable: True when rank 0's newest durable checkpoint is newer than every
            in-memory commit: rank 0 loads it first, then is the source.
        held_by_all: every rank holds that very commit already (the same version, made in
            the same round): nothing needs to be sent.
        receivers: the ranks that lack the source's very commit (another version, or the
            same version made in another round, or no round at all): the ranks it is sent to.
        version: the newest in-memory commit's version, over all ranks.
        synced_before: some rank holds state synced in an earlier group (a non-zero lineage).
        durable_unreadable: rank 0 could not read its checkpoint storage (``DURABLE_UNREADABLE``).
    """

    rank: int
    from_durable: bool
    held_by_all: bool = False
    receivers: tuple[int, ...] = ()
    version: int = 0
    synced_before: bool = False
    durable_unreadable: bool = False


def newest_source(version: int, durable_version: int = 0,
                  group: dist.ProcessGroup | None = None, lineage: int = 0) -> Source:
    """Chooses the holder of the newest state; every rank of ``group`` gets the same answer.

    Collective: all-gathers each rank's commit version and lineage (and rank 0's newest
    durable version). The newest in-memory commit wins, the lowest rank among equals (the last
    collective can have succeeded on one rank and failed on another, so the plan's guess is
    checked here). Ranks of one version and one non-zero lineage hold the same commit, so
    only the others are named receivers.

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
                        device=transport_device(group))
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    versions = [int(g[0].item()) for g in gathered]
    newest_durable = int(gathered[0][1].item())
    others = tuple(r for r in range(len(gathered)) if r != 0)
    if newest_durable > max(versions):
        return Source(rank=0, from_durable=True, receivers=others)
    held = [(int(g[0].item()), int(g[2].item())) for g in gathered]
    src = versions.index(max(versions))
    receivers = tuple(r for r, commit in enumerate(held)
                      if r != src and (commit != held[src] or commit[1] == 0))
    return Source(rank=src, from_durable=False, held_by_all=not receivers,
                  receivers=receivers, version=max(versions),
                  synced_before=any(line != 0 for _, line in held),
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


def landing_tensors(skeleton: Any, into: Any, device: torch.device) -> dict[int, torch.Tensor]:
    """The tensors of ``into`` that can take the skeleton's slots in place.

    A slot lands in the tensor at its own path in ``into`` (the same keys and positions) when
    that tensor is a plain, contiguous tensor on ``device`` of the slot's shape and dtype, and
    its memory overlaps no other landing tensor (tied weights land once; the others are
    received apart).

    Args:
        skeleton: a decoded skeleton (tensors as ``TensorSlot``).
        into: a tree shaped like the payload, holding the receiver's own tensors.
        device: where the tensors are received.

    Returns:
        ``{slot index: tensor}`` (detached) for every slot that lands in place.
    """
    found: list[tuple[int, torch.Tensor]] = []
    _pair_slots(skeleton, into, device, found)
    chosen: dict[int, torch.Tensor] = {}
    reach = -1
    for index, tensor in sorted(found, key=lambda item: item[1].data_ptr()):
        start = tensor.data_ptr()
        if start >= reach:
            chosen[index] = tensor
            reach = start + tensor.numel() * tensor.element_size()
    return chosen


def _pair_slots(skeleton: Any, into: Any, device: torch.device,
                found: list[tuple[int, torch.Tensor]]) -> None:
    if isinstance(skeleton, TensorSlot):
        if isinstance(into, torch.Tensor):
            tensor = into.detach()
            if (type(tensor) is torch.Tensor and tensor.layout == torch.strided
                    and tensor.device == device and tensor.dtype == skeleton.dtype
                    and tuple(tensor.shape) == skeleton.shape and skeleton.nbytes
                    and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()):
                found.append((skeleton.index, tensor))
    elif isinstance(skeleton, Mapping) and isinstance(into, Mapping):
        for key, value in skeleton.items():
            if key in into:
                _pair_slots(value, into[key], device, found)
    elif isinstance(skeleton, (list, tuple)) and isinstance(into, (list, tuple)):
        for value, own in zip(skeleton, into):
            _pair_slots(value, own, device, found)


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


def transport_device(group: dist.ProcessGroup | None) -> torch.device:
    """CUDA (current device) for an NCCL group, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
