"""What an elastic training loop repeats, done once: the helpers behind ``state.batches``,
``state.ddp`` and ``state.print``.

Owns nothing but the bookkeeping every loop writes the same way (the sampler's epoch, counting
consumed batches, a commit every N batches, a durable one when the epoch's batches are done),
so that the elastic twin of a single-process script differs from it by a handful of lines. Each
helper is optional: the explicit calls they stand for stay public and documented.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from elastic.ddp_sync import same_on_every_rank
from elastic.state import ElasticSampler


class BatchInHand:
    """The batch that a ``batches()`` loop's body holds and its sampler has not recorded yet.
    A ``commit_step()`` block in the body records it as it leaves: the step it applied is in
    that commit, so its batch must be too (else a rollback to it trains the batch again)."""

    def __init__(self) -> None:
        self._held: tuple[ElasticSampler, Any] | None = None

    def hold(self, sampler: ElasticSampler, batch: Any) -> None:
        self._held = sampler, batch

    def record(self) -> None:
        """Records the batch in hand in its sampler, once (nothing when none is held)."""
        held, self._held = self._held, None
        if held is not None:
            held[0].record_batch(batch_length(held[1]))

    def drop(self) -> None:
        """Forgets the batch in hand unrecorded (a rollback: the body never finished it)."""
        self._held = None


def batches(loader: Iterable[Any], commit: Callable[..., Any], epoch: Any = None,
            commit_every: int | None = None, checkpoint_at_end: bool = False,
            hand: BatchInHand | None = None) -> Iterator[Any]:
    """Yields ``loader``'s batches and does the loop's bookkeeping around them.

    Before the first batch: ``sampler.set_epoch(epoch)`` when the loader's sampler is an
    ``ElasticSampler`` and ``epoch`` (the state's plain ``epoch``) is an int. After each batch
    (once the loop's body is done with it, or as a ``commit_step()`` block in the body leaves:
    ``hand``): ``sampler.record_batch(len(batch))`` and, every
    ``commit_every`` batches of the epoch, ``commit()``. After the last one, with
    ``checkpoint_at_end``: ``commit(durable=True)``, unless the loader yielded nothing this
    time (a loop re-entered at the very end of an epoch, or a finished job resumed: nothing
    new to save, and a run that trains nothing must not look as if it did). Leaving the loop
    early (``break``, an error) records nothing for the batch in hand.

    Raises:
        ValueError: ``commit_every`` is below 1.
        TypeError: a batch has no length to record (record it yourself with
            ``state.sampler.record_batch(n)``).
    """
    if commit_every is not None and commit_every < 1:
        raise ValueError(f"commit_every ({commit_every}) must be >= 1, or None for no commits.")
    sampler = getattr(loader, "sampler", None)
    sampler = sampler if isinstance(sampler, ElasticSampler) else None
    if sampler is not None and isinstance(epoch, int) and not isinstance(epoch, bool):
        sampler.set_epoch(epoch)
    hand = hand or BatchInHand()
    yielded = 0
    for batch in loader:
        if sampler is not None:
            hand.hold(sampler, batch)
        yield batch
        yielded += 1
        done = yielded
        if sampler is not None:
            hand.record()  # unless a commit_step() in the body did
            done = sampler.batches_done  # counts the epoch's batches across re-formations
        if commit_every is not None and done % commit_every == 0:
            commit()
    if checkpoint_at_end and yielded:
        commit(durable=True)


def batch_length(batch: Any) -> int:
    """The number of samples in a batch: a tensor's first dimension, or that of the first
    tensor of a tuple, list or dict.

    Raises:
        TypeError: no tensor to measure.
    """
    first = batch
    while isinstance(first, (tuple, list, Mapping)) and len(first):
        first = next(iter(first.values())) if isinstance(first, Mapping) else first[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return int(first.shape[0])
    raise TypeError(f"cannot tell how many samples a batch of type {type(batch).__name__} holds; "
                    "call state.sampler.record_batch(n) yourself after each batch.")


def ddp(module: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
    """``DistributedDataParallel(module)`` on the current group, on the module's own GPU when it
    has one (``device_ids``), with ``kwargs`` passed on; without DDP's broadcast of the
    parameters and buffers when every rank holds them alike already (``ddp_sync``)."""
    device = next(module.parameters()).device
    if device.type == "cuda" and "device_ids" not in kwargs:
        kwargs["device_ids"] = [device.index]
    if "init_sync" not in kwargs and same_on_every_rank(module, kwargs.get("process_group")):
        kwargs["init_sync"] = False
    return DistributedDataParallel(module, **kwargs)


def print_main(is_main: bool, *args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only."""
    if is_main:
        builtins.print(*args, **kwargs)


def samples_done(train: Any) -> dict[str, int]:
    """``{"samples": n}``: the samples of the current epoch the first registered
    ``ElasticSampler`` handed out (for the progress event and its metric); empty without one."""
    for obj in train.stateful_objects().values():
        if isinstance(obj, ElasticSampler):
            return {"samples": obj.consumed}
    return {}
