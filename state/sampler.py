"""``ElasticSampler``: a data-parallel sampler that hands each sample out once per epoch.

Owns the partition of an epoch's permutation over a changing world and the small,
versioned state that makes a re-formation resume exactly where the group left off. Pure
logic: gets rank and world size through ``set_topology``; never reads environment
variables or torch.distributed globals; must not import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from elastic.state.errors import StateError, StateKeyError
from elastic.state.global_batch import Share, share_of

__all__ = ["ElasticSampler", "split_counts"]
log = logging.getLogger(__name__)

_FORMAT_VERSION = 1
_KEYS = frozenset({"format_version", "epoch", "seed", "consumed", "batches_done", "batch_size", "skipped"})


def split_counts(remaining: int, world_size: int, batch_size: int, drop_last: bool) -> list[int]:
    """Number of items each rank takes from the ``remaining`` items of an epoch.

    Every rank first takes the same number of full batches. The tail (fewer than
    ``batch_size * world_size`` items) is split as evenly as possible, interleaved, so
    every rank has exactly one more (possibly short) batch; a tail smaller than the world
    (or any tail with ``drop_last``) is skipped, because some rank would have no batch.

    Args:
        remaining: Items of the permutation not yet consumed.
        world_size: Number of ranks.
        batch_size: Items per full batch.
        drop_last: Skip the tail even when it could be split.

    Returns:
        Items per rank, indexed by rank. Their sum is at most ``remaining``.
    """
    full = remaining // (batch_size * world_size) * batch_size
    tail = remaining - full * world_size
    if drop_last or tail < world_size:
        return [full] * world_size
    return [full + (tail - rank + world_size - 1) // world_size for rank in range(world_size)]


@dataclass
class _Split:
    """One rank's share of the items not yet consumed when an iteration started."""

    base: int            # global consumed when the split started
    rank: int
    world_size: int
    position: int = 0    # items this rank has recorded in this split
    counts: list[int] | None = None  # per-rank item counts, fixed once the tail is reached


class ElasticSampler(Sampler[int]):
    """A data-parallel sampler that hands each sample out exactly once per epoch.

    The epoch's permutation depends only on ``(seed, epoch)``. ``consumed`` is the length
    of the prefix of that permutation the group has used (or skipped). On each
    ``__iter__`` the rest is split interleaved: rank ``r`` of ``W`` takes
    ``rest[r::W]``, so after every rank has recorded ``k`` items the first ``k * W`` items
    are consumed and ``consumed`` stays a prefix across any number of re-formations.

    Every rank yields the same number of batches (DDP would hang otherwise) and no item
    is repeated to pad. With batch size ``b``: all ranks take the full global batches
    (``b * W`` items each); the final, smaller global batch is split as evenly as possible
    so that each rank has one short batch. If that tail has fewer than ``W`` items (some
    rank would get nothing), or always with ``drop_last=True``, the tail is **skipped**
    for this epoch: ``skipped`` counts it and ``skipped_indices()`` lists it (always the
    end of the permutation). It is handed out again in later epochs, like any sample.

    The batch size is the hint ``batch_size`` or, when absent, learned from the largest
    batch given to ``record_batch`` (and kept in the state). The tail cutoff is decided
    lazily when iteration reaches it, with the batch size known then (1 if still
    unknown). Under DataLoader prefetching an epoch smaller than the prefetch window
    can reach the tail before the first ``record_batch``; pass ``batch_size`` to be
    exact there.

    Consumption is advanced only by ``record_batch`` (called after each trained batch),
    never by iteration, so prefetching (``num_workers > 0``) does not lose samples.
    The sampler is iterated in the main process.

    **Constant global batch** (``global_batch_size=B``): global step ``k`` trains positions
    ``k*B .. k*B+B-1`` of the permutation whatever the world size, split into contiguous
    shares differing by at most one sample; the sampler then yields **lists** (this rank's
    share of each global batch: pass it as a DataLoader's ``batch_sampler``), ``share()``
    describes the batch being trained and ``share().loss_scale`` weights the summed loss
    so that DDP's average is the mean over the global batch. The epoch's last global batch
    holds the ``T < B`` samples left and follows the same rule (unless ``drop_last``, which
    skips it); a rank without a sample (``T`` or ``B`` smaller than the world) trains one
    dummy sample with ``loss_scale`` 0, so every rank still runs forward and backward.

    Args:
        dataset: Anything with ``__len__``.
        shuffle: Use a seeded random permutation, else ``0..n-1`` in order.
        seed: Seed of the permutation; epoch ``e`` uses ``seed + e``.
        drop_last: Always skip the final partial global batch.
        batch_size: Items per batch, if known in advance.
        global_batch_size: Switches to constant-global-batch mode with this ``B``.

    Raises:
        ValueError: A batch size is not positive, both are given, or ``dataset`` has no
            length.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, batch_size: int | None = None,
                 global_batch_size: int | None = None) -> None:
        if not hasattr(dataset, "__len__"):
            raise ValueError(f"dataset ({type(dataset).__name__}) must have a length.")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be >= 1 or None.")
        if global_batch_size is not None and (global_batch_size < 1 or batch_size is not None):
            raise ValueError(f"global_batch_size ({global_batch_size}) must be >= 1 and comes "
                             f"without batch_size ({batch_size}); pass only one of them.")
        self._global_batch = global_batch_size
        self._size = len(dataset)
        self._shuffle = bool(shuffle)
        self._drop_last = bool(drop_last)
        self._seed = int(seed)
        self._batch_size = batch_size
        self._epoch = 0
        self._consumed = 0
        self._batches_done = 0
        self._skipped = 0
        self._rank, self._world_size = 0, 1
        self._split: _Split | None = None
        self._perm_cache: tuple[tuple[int, int], list[int]] | None = None

    # -- read-only state -----------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def seed(self) -> int:
        """Seed of the permutation (and of ``SeededDataset``'s per-sample seeds)."""
        return self._seed

    @property
    def global_batch_size(self) -> int | None:
        """``B`` in constant-global-batch mode, else None."""
        return self._global_batch

    @property
    def consumed(self) -> int:
        """Length of the prefix of this epoch's permutation used or skipped by the group."""
        return self._consumed

    @property
    def batches_done(self) -> int:
        """Batches recorded in this epoch, across re-formations."""
        return self._batches_done

    @property
    def batch_size(self) -> int | None:
        """Items per batch: the hint or the learned size; None while unknown."""
        return self._batch_size

    @property
    def skipped(self) -> int:
        """Items at the end of this epoch's permutation that were skipped (tail rule)."""
        return self._skipped

    def skipped_indices(self) -> list[int]:
        """Returns the dataset indices skipped in this epoch (the permutation's end)."""
        return self._permutation()[self._size - self._skipped:] if self._skipped else []

    # -- control -------------------------------------------------------------------------

    def set_topology(self, rank: int, world_size: int) -> None:
        """Sets this process's place in the world; the next iteration re-splits.

        Args:
            rank: This process's rank, ``0 <= rank < world_size``.
            world_size: Number of ranks, at least 1.

        Raises:
            ValueError: The values are out of range.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank ({rank}) must satisfy 0 <= rank < world_size ({world_size}).")
        self._rank, self._world_size = int(rank), int(world_size)
        self._split = None

    def set_epoch(self, epoch: int) -> None:
        """Moves to ``epoch``; the current epoch keeps its position, another starts over.

        Args:
            epoch: The epoch to sample.
        """
        if epoch == self._epoch:
            return
        self._epoch = int(epoch)
        self._consumed = self._batches_done = self._skipped = 0
        self._split = None

    def record_batch(self, n: int) -> None:
        """Records that this rank trained on its next ``n`` items.

        Call it after every batch with the local batch length. All ranks record in
        lockstep (DDP), so they agree on ``consumed`` and ``batches_done``.

        Args:
            n: Items in the batch just trained, at least 1.

        Raises:
            ValueError: ``n`` is not positive.
        """
        if n < 1:
            raise ValueError(f"record_batch(n) needs n ({n}) >= 1.")
        if self._global_batch is not None:
            self._record_global(n)
            return
        if self._batch_size is None or n > self._batch_size:
            self._batch_size = int(n)
        split = self._split or self._start_split()
        split.position += n
        self._batches_done += 1
        counts = split.counts or split_counts(self._size - split.base, split.world_size,
                                              self._batch_size, self._drop_last)
        if split.position >= counts[split.rank]:
            # This rank is through its share; so is every rank (same number of batches).
            self._skipped = self._size - split.base - sum(counts)
            self._consumed = self._size
        else:
            self._consumed = min(split.base + split.position * split.world_size,
                                 split.base + sum(counts))

    # -- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        if self._global_batch is not None:
            return self._iter_global()  # type: ignore[return-value]
        split = self._start_split()
        mine = self._permutation()[split.base + split.rank::split.world_size]
        return self._generate(split, mine)

    def _generate(self, split: _Split, mine: list[int]) -> Iterator[int]:
        """Yields this rank's items, fixing the tail cutoff when iteration reaches it.

        The cutoff is decided with the batch size known when item ``i`` is reached; the
        limit it implies is recomputed only when that batch size changes (this runs per item).
        """
        known_batch, limit = -1, 0
        end = len(mine) if split.counts is None else split.counts[split.rank]
        for i, index in enumerate(mine):
            if split.counts is None:
                if self._batch_size != known_batch:
                    known_batch = self._batch_size
                    batch = known_batch or 1
                    limit = (self._size - split.base) // (batch * split.world_size) * batch
                if i >= limit:
                    split.counts = split_counts(self._size - split.base, split.world_size,
                                                known_batch or 1, self._drop_last)
                    end = split.counts[split.rank]
            if i >= end:
                break
            yield index
        if split.counts is None:
            split.counts = split_counts(self._size - split.base, split.world_size,
                                        self._batch_size or 1, self._drop_last)
        if not any(split.counts) and split.base < self._size and self._split is split:
            # No rank has a batch, so no record_batch will come: the whole rest is skipped.
            self._skipped = self._size - split.base
            self._consumed = self._size
            if split.base == 0 and split.rank == 0:
                most = self._size // (self._batch_size or 1) if self._drop_last else self._size
                log.warning(
                    "ElasticSampler: epoch %d trains no sample: %d samples are too few for %d "
                    "ranks, so all of them are skipped. Use at most %d workers, or a larger "
                    "dataset.", self._epoch, self._size, split.world_size, max(1, most))

    def __len__(self) -> int:
        if self._global_batch is not None:
            return -(-(self._global_limit() - self._consumed) // self._global_batch)
        split = self._split
        base, rank, world = ((split.base, split.rank, split.world_size) if split
                             else (self._consumed, self._rank, self._world_size))
        if split is not None and split.counts is not None:
            return split.counts[rank]
        return split_counts(self._size - base, world, self._batch_size or 1, self._drop_last)[rank]

    # -- constant global batch ---------------------------------------------------------------

    def share(self) -> Share:
        """This rank's share of the global batch being trained (the next to be recorded).

        Call it between taking a batch from the loader and ``record_batch``; it depends only
        on the committed position, so it is right under DataLoader prefetching.

        Raises:
            StateError: Not in constant-global-batch mode, or the epoch has no batch left.
        """
        if self._global_batch is None:
            raise StateError("share() needs constant-global-batch mode; construct the sampler "
                             "with ElasticSampler(..., global_batch_size=B).")
        if self._consumed >= self._global_limit():
            raise StateError(f"epoch {self._epoch} has no global batch left (consumed "
                             f"{self._consumed} of {self._size}); call set_epoch(epoch + 1).")
        return share_of(self._consumed, self._size, self._global_batch, self._rank,
                        self._world_size)

    def _global_limit(self) -> int:
        """End of the positions trained this epoch (``drop_last`` cuts the short batch)."""
        assert self._global_batch is not None
        if self._drop_last:
            return self._size // self._global_batch * self._global_batch
        return self._size

    def _iter_global(self) -> Iterator[list[int]]:
        """Yields this rank's share of every global batch left in the epoch."""
        assert self._global_batch is not None
        perm, limit = self._permutation(), self._global_limit()
        self._skip_global_tail()
        rank, world = self._rank, self._world_size
        for start in range(self._consumed, limit, self._global_batch):
            share = share_of(start, self._size, self._global_batch, rank, world)
            yield [perm[p] for p in share.positions]

    def _record_global(self, n: int) -> None:
        """Advances by one global batch; ``n`` must be this rank's share length."""
        share = self.share()
        if n != len(share.positions):
            raise ValueError(f"record_batch(n={n}) but this rank's share of global step "
                             f"{share.step} has {len(share.positions)} samples; pass the sampler "
                             f"as DataLoader(batch_sampler=...) and record len(batch).")
        self._consumed += share.total
        self._batches_done += 1
        self._skip_global_tail()

    def _skip_global_tail(self) -> None:
        """With ``drop_last``, marks a last global batch shorter than ``B`` as skipped."""
        if self._global_limit() <= self._consumed < self._size:
            self._skipped = self._size - self._consumed
            self._consumed = self._size

    def _start_split(self) -> _Split:
        """Begins a new split of the unconsumed items over the current topology."""
        self._split = _Split(self._consumed, self._rank, self._world_size)
        return self._split

    def _permutation(self) -> list[int]:
        """This epoch's permutation of ``range(len(dataset))``, cached."""
        key = (self._seed, self._epoch)
        if self._perm_cache is None or self._perm_cache[0] != key:
            if self._shuffle:
                generator = torch.Generator()
                generator.manual_seed(self._seed + self._epoch)
                order = torch.randperm(self._size, generator=generator).tolist()
            else:
                order = list(range(self._size))
            self._perm_cache = (key, order)
        return self._perm_cache[1]

    # -- Stateful ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Returns the small, plain, versioned state (no index lists)."""
        return {"format_version": _FORMAT_VERSION, "epoch": self._epoch, "seed": self._seed,
                "consumed": self._consumed, "batches_done": self._batches_done,
                "batch_size": self._batch_size, "skipped": self._skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replaces the state; the next iteration starts from ``consumed``.

        Args:
            state_dict: A dict from ``state_dict()``.

        Raises:
            StateKeyError: Keys are missing or unknown (both are named).
            StateError: The format version or a value is not supported.
        """
        missing, unknown = sorted(_KEYS - set(state_dict)), sorted(set(state_dict) - _KEYS)
        if missing or unknown:
            raise StateKeyError(f"ElasticSampler state has missing keys {missing} and unknown keys {unknown}.")
        if state_dict["format_version"] != _FORMAT_VERSION:
            raise StateError(f"ElasticSampler state format_version ({state_dict['format_version']}) "
                             f"is not supported; expected {_FORMAT_VERSION}.")
        consumed, skipped = int(state_dict["consumed"]), int(state_dict["skipped"])
        if not 0 <= consumed <= self._size or not 0 <= skipped <= consumed:
            raise StateError(f"ElasticSampler state consumed ({consumed}) / skipped ({skipped}) "
                             f"do not fit a dataset of {self._size} items.")
        self._epoch, self._seed = int(state_dict["epoch"]), int(state_dict["seed"])
        self._consumed, self._skipped = consumed, skipped
        self._batches_done = int(state_dict["batches_done"])
        batch_size = state_dict["batch_size"]
        self._batch_size = None if batch_size is None else int(batch_size)
        self._split = None
