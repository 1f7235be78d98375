"""Host memory for the sharded commits, recycled: the shards of dropped commits hold the next
commits' copies, so a steady commit neither allocates nor page-faults its shards again.

A ``HostShard`` is one shard's tensors (flat name -> tensor) carved as views out of one host
slab: one allocation per shard, pinned when the sources live on a GPU (torch's pinned
allocator rounds each allocation up to a power of two, so one slab rounds once, not once per
tensor). ``ShardBuffers`` keeps shards handed back for reuse, by their layout (every tensor's
name, shape and dtype) and pinning, at most ``limit`` of them (one commit's worth: a rank's own
shard and its buddies'), the oldest going first (after a reshard: the old layout's). A shard
of a new layout (a reshard's) is carved out of the smallest free slab of another layout that
holds it, if any: that memory is touched already, where a new slab costs a page fault every
4 KiB.

Lifetime: a shard is taken for the own copy of a commit (``host_copy``), a buddy copy about to
be received (``copies``) or a reshard's new shard (``moves``), and given back only by
``ShardCommits`` when it drops a commit that holds it, that commit has no exchange in flight
and no kept commit holds the shard too. Nothing else reads a held shard: the reshard reads
the chosen commit while it is kept (and waits for every send before returning); the durable
writer reads the live objects; a live (copy-free) commit holds the model's own tensors, never
given. A commit whose exchange failed keeps its shards out of reuse for good (a receive left
behind may still write them), as does a reshard whose moves failed its new shard; both are
freed once the last reference goes. Torch only.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import torch

ALIGN = 64  # bytes: every view starts on a cache line

Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


class HostShard(dict[str, torch.Tensor]):
    """One shard's tensors by flat name, views into one host slab."""

    def __init__(self, key: tuple[Any, ...], slab: torch.Tensor,
                 tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.key = key
        self.slab = slab


def shapes_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...],
                                                                      torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def _sizes(shapes: Shapes) -> dict[str, int]:
    return {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in shapes.items()}


def slab_bytes(shapes: Shapes) -> int:
    """The bytes of a slab that holds ``shapes``, each view aligned."""
    return sum(-(-size // ALIGN) * ALIGN for size in _sizes(shapes).values())


def carve(shapes: Shapes, pinned: bool, slab: torch.Tensor | None = None) -> HostShard:
    """A ``HostShard`` of ``shapes`` (uninitialised) in one slab: a new one, or ``slab`` (a
    uint8 host tensor of at least ``slab_bytes(shapes)``, pinned as ``pinned`` says)."""
    sizes = _sizes(shapes)
    if slab is None:
        slab = torch.empty(slab_bytes(shapes), dtype=torch.uint8, pin_memory=pinned)
    tensors, at = {}, 0
    for name, (shape, dtype) in shapes.items():
        tensors[name] = slab[at: at + sizes[name]].view(dtype).view(shape)
        at += -(-sizes[name] // ALIGN) * ALIGN
    return HostShard(_key(shapes, pinned), slab, tensors)


def _key(shapes: Shapes, pinned: bool) -> tuple[Any, ...]:
    return pinned, tuple(sorted(((name, shape, dtype) for name, (shape, dtype) in shapes.items()),
                                key=lambda entry: entry[0]))


class ShardBuffers:
    """Shards handed back by dropped commits, for the next commits to fill; thread-safe.

    Args:
        limit: the most shards kept for reuse (one commit's worth; ``keep_at_least`` raises
            it).
    """

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit ({limit}) must be >= 0.")
        self._limit = limit
        self._lock = threading.Lock()
        self._free: list[HostShard] = []  # oldest first
        self.carved = 0  # shards allocated, for tests and measurements

    def keep_at_least(self, count: int) -> None:
        """Raises the limit to ``count`` shards: a rank on uneven nodes may hold more shards of
        a commit than its own and ``buddies`` copies."""
        with self._lock:
            self._limit = max(self._limit, count)

    def take(self, shapes: Shapes, pinned: bool = False) -> HostShard:
        """A shard of ``shapes``: one handed back, else one carved out of the smallest free
        slab of another layout that holds it, else a new one. Its contents are stale."""
        key = _key(shapes, pinned)
        with self._lock:
            for at, shard in enumerate(self._free):
                if shard.key == key:
                    return self._free.pop(at)
            need = slab_bytes(shapes)  # a commit's take in a steady layout stops above
            fits = [at for at, shard in enumerate(self._free)
                    if shard.key[0] == pinned and shard.slab.numel() >= need]
            if fits:
                at = min(fits, key=lambda i: self._free[i].slab.numel())
                return carve(shapes, pinned, self._free.pop(at).slab)
            self.carved += 1
        return carve(shapes, pinned)

    def give(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Takes ``tensors`` back for reuse when ``take`` made them (a commit's live tensors,
        or a shard from elsewhere, are left alone); the oldest go past ``limit``."""
        if not isinstance(tensors, HostShard):
            return
        with self._lock:
            if any(shard is tensors for shard in self._free):
                return
            self._free.append(tensors)
            del self._free[: max(0, len(self._free) - self._limit)]

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)
