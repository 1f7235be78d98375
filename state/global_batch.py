"""Constant-global-batch arithmetic: which positions of an epoch each rank trains at a step.

Owns the pure rule behind ``ElasticSampler(global_batch_size=B)``: global step ``k`` of an
epoch covers positions ``k*B .. k*B+B-1`` of the epoch's permutation (the last step only the
``T < B`` positions left), split into contiguous, as-even-as-possible shares over the ranks
of the moment; plus the loss factor that makes DDP's average of per-rank gradients equal the
mean over the global batch, and per-sample seeds. No torch.distributed, no I/O; must not
import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Share", "share_of", "sample_seed"]

_MASK64 = (1 << 64) - 1


def sample_seed(*parts: int) -> int:
    """Mixes integers (seed, epoch, position, ...) into one well-spread 63-bit seed.

    SplitMix64 over the parts in order: the same parts give the same seed on every
    machine, world size and DataLoader worker; neighbouring positions give unrelated seeds.

    Args:
        *parts: Non-negative integers, for example ``(seed, epoch, position)``.

    Returns:
        A seed in ``[0, 2**63)``, usable with ``torch.Generator().manual_seed``.
    """
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (int(part) & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1


@dataclass(frozen=True)
class Share:
    """This rank's part of one global batch.

    Attributes:
        step: The global step within the epoch (``0`` is the epoch's first batch).
        start: Position in the epoch's permutation of this rank's first sample.
        size: Real samples in this rank's share; ``0`` when the global batch is smaller
            than the world, in which case the rank trains one dummy sample with weight 0.
        total: Samples in the whole global batch (``B``, or fewer for the epoch's last).
        world_size: Ranks sharing the global batch.
    """

    step: int
    start: int
    size: int
    total: int
    world_size: int

    @property
    def loss_scale(self) -> float:
        """Factor for this rank's **summed** loss: ``world_size / total``, 0 for a dummy.

        DDP averages gradients over ranks, so ``(1/W) * sum_r (W/T) * grad(sum of share r)``
        is ``grad(mean over the T samples)``, however unevenly the shares are sized.
        """
        return self.world_size / self.total if self.size else 0.0

    @property
    def positions(self) -> range:
        """Permutation positions of the samples this rank trains (the dummy's for size 0)."""
        return range(self.start, self.start + max(self.size, 1))

    def seeds(self, seed: int, epoch: int) -> list[int]:
        """One seed per trained sample, from ``(seed, epoch, position)``: world-size free.

        Args:
            seed: A base seed (for example drawn once per step from the committed RNG).
            epoch: The epoch.

        Returns:
            ``sample_seed(seed, epoch, p)`` for each ``p`` in ``positions``.
        """
        return [sample_seed(seed, epoch, p) for p in self.positions]


def share_of(start: int, size: int, global_batch: int, rank: int, world_size: int) -> Share:
    """The share of ``rank`` in the global batch that begins at position ``start``.

    Shares are contiguous and differ by at most one sample: rank ``r`` gets
    ``T // W + (r < T % W)`` samples, ``T = min(global_batch, size - start)``. A rank with
    no sample (``T < W``) gets the global batch's first position as a dummy.

    Args:
        start: First permutation position of the global batch (``step * global_batch``).
        size: Length of the dataset (the permutation).
        global_batch: The global batch size ``B``.
        rank: This rank.
        world_size: Number of ranks.

    Returns:
        The share.
    """
    assert 0 <= start < size and 0 <= rank < world_size, (start, size, rank, world_size)
    total = min(global_batch, size - start)
    base, extra = divmod(total, world_size)
    count = base + (rank < extra)
    offset = rank * base + min(rank, extra)
    first = start + offset if count else start
    return Share(step=start // global_batch, start=first, size=count, total=total,
                 world_size=world_size)
