"""The buddy copies of a commit: each rank sends its own shard to its buddies and receives the
shards of the ranks it is a buddy of, point to point on a group of their own.

The exchange runs on a thread (``BuddyExchange.start``), so training goes on while it travels
(after a reshard done in place, the thread first lands what the reshard left for later and
copies the commit's own shard out of the live objects, and the next optimizer step waits for
both: ``wait_own``);
every rank posts its sends and receives tensor by tensor in the same order, and waits for the
oldest ones whenever more than ``max_in_flight`` bytes are under way. The received shards
land in memory recycled from dropped commits (``ShardCommits.buffers``) and are recorded only
once all of them arrived. The group is not the training group, so a copy never interleaves
with (or blocks) the step's collectives. Torch only.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.state.errors import SyncError
from elastic.state.sharded.commits import ShardCommit, ShardCommits
from elastic.state.sharded.layout import buddy_ranks, shard_range
from elastic.state.sharded.shards import host_copy

DEFAULT_IN_FLIGHT = 64 << 20


class BuddyCopyError(SyncError):
    """A buddy copy did not complete (a peer failed while it travelled)."""


def shard_shape(commit: ShardCommit, name: str, shard: int) -> tuple[int, ...]:
    """The shape of ``shard``'s part of tensor ``name`` (its trailing dims from this rank's own
    part, which every shard shares)."""
    own = commit.held[commit.own][name]
    spec = commit.specs[name]
    if not spec.sharded:
        return tuple(own.shape)
    start, stop = shard_range(spec.rows, commit.shards, shard)
    return (stop - start, *own.shape[1:])


def _failed(what: str, exc: BaseException) -> BaseException:
    """The error a wait raises for ``exc`` of the exchange's thread: ``BuddyCopyError`` for a
    peer's failure (torch's ``RuntimeError`` family, ``ValueError``), which re-forms the job;
    anything else as it is, a fault of this rank that a re-formation would only repeat."""
    if isinstance(exc, (RuntimeError, ValueError)):
        error = BuddyCopyError(f"{what}: {exc}")
        error.__cause__ = exc
        return error
    return exc


class BuddyExchange:
    """Sends and receives one commit's buddy copies, on a thread.

    Args:
        group: the copies' own process group (all ranks of the round).
        rank: this rank in it.
        copies: how many buddies each rank has (0 for HSDP, whose replicas hold each shard).
        nodes: one node id per rank (buddies on another node first).
        max_in_flight: bytes under way at most before waiting.
    """

    def __init__(self, group: Any, rank: int, world: int, copies: int, nodes: Sequence[int],
                 max_in_flight: int = DEFAULT_IN_FLIGHT) -> None:
        self._group = group
        self._rank = rank
        self._buddies = buddy_ranks(rank, world, copies, nodes)
        self._senders = [r for r in range(world) if rank in buddy_ranks(r, world, copies, nodes)]
        self._max_in_flight = max_in_flight
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._own_copied = threading.Event()
        self._own_copied.set()
        self._own_error: BaseException | None = None

    def start(self, commit: ShardCommit, commits: ShardCommits,
              own_from: Mapping[str, torch.Tensor] | None = None,
              landing: Callable[[], None] | None = None) -> None:
        """Starts sending ``commit``'s own shard (the previous exchange must be waited for).

        Args:
            own_from: the live local parts (on the CPU) to copy ``commit``'s own shard from
                first, on the thread, when it holds none yet; nothing may write them until
                ``wait_own`` returned.
            landing: with ``own_from``: lands the rest of those parts (a reshard's deferred
                pieces, on this exchange's group) before they are copied.
        """
        assert self._thread is None, "wait() for the previous exchange first"
        self._error = self._own_error = None
        if own_from is not None:
            self._own_copied.clear()
        commits.sending(commit)  # before the thread: its shards are not reused from now on
        self._thread = threading.Thread(target=self._run,
                                        args=(commit, commits, own_from, landing),
                                        name="elastic-buddy-copies", daemon=True)
        self._thread.start()

    def wait_own(self, timeout: timedelta) -> None:
        """Returns once the own shard that ``start`` copies (if any) landed and is copied.

        Raises:
            BuddyCopyError: it was not within ``timeout``, or its landing failed (a peer
                failed: the live parts are incomplete).
            Exception: what else the landing or copy raised on this rank, as it is.
        """
        if not self._own_copied.wait(timeout.total_seconds()):
            raise BuddyCopyError(f"the commit's own shard was not copied within {timeout}.")
        if self._own_error is not None:
            raise _failed("the reshard's last pieces did not land", self._own_error)

    def wait(self, timeout: timedelta) -> None:
        """Returns once the exchange in flight (if any) completed.

        Raises:
            BuddyCopyError: it failed (a peer), or did not end within ``timeout``.
            Exception: what else failed on this rank, as it is (``settle``).
        """
        self.settle(timeout, lambda: False, timeout)

    def settle(self, timeout: timedelta, released: Callable[[], bool],
               grace: timedelta) -> None:
        """Like ``wait``, but once ``released()`` (asked every ``grace``) says that the round
        was released, for one more ``grace`` at most: a copy that the release did not wake is
        left to its thread, which ends with its group's timeout.

        Raises:
            BuddyCopyError: it failed (a peer), or did not end in time.
            Exception: what else failed on this rank, as it is.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return
        deadline = time.monotonic() + timeout.total_seconds()
        last = False  # the round was released: this is the last grace
        while thread.is_alive() and not last and time.monotonic() < deadline:
            last = released()
            thread.join(max(0.0, min(grace.total_seconds(), deadline - time.monotonic())))
        if thread.is_alive():
            raise BuddyCopyError("the buddy copies did not complete "
                                 f"{'after the release' if last else f'within {timeout}'}.")
        if self._error is not None:
            raise _failed("a buddy copy failed", self._error)

    def _run(self, commit: ShardCommit, commits: ShardCommits,
             own_from: Mapping[str, torch.Tensor] | None,
             landing: Callable[[], None] | None) -> None:
        try:
            if own_from is not None:
                try:
                    if landing is not None:
                        landing()
                    commits.hold(commit, {commit.own: host_copy(own_from, commits.buffers)})
                except Exception as exc:  # the training thread raises it (``wait_own``)
                    self._own_error = exc
                    raise
                finally:
                    self._own_copied.set()
            self.exchange(commit, commits)
        except Exception as exc:  # torch's DistError family (a peer failed), or a bug here
            self._error = exc

    def exchange(self, commit: ShardCommit, commits: ShardCommits) -> int:
        """Sends and receives every tensor of the commit; returns the bytes sent."""
        commits.sending(commit)
        own = commit.held[commit.own]
        names = sorted(commit.specs)
        received = {src: commits.buffers.take({
            name: (shard_shape(commit, name, src % commit.shards), own[name].dtype)
            for name in names}) for src in self._senders}
        in_flight: deque[tuple[Any, int]] = deque()
        pending = sent = 0
        for tag, name in enumerate(names):
            tensor = own[name]
            for dst in self._buddies:
                if tensor.numel():
                    in_flight.append((dist.isend(tensor, dst, group=self._group, tag=tag),
                                      tensor.nbytes))
                    pending += tensor.nbytes
                    sent += tensor.nbytes
            for src in self._senders:
                buffer = received[src][name]
                if buffer.numel():
                    in_flight.append((dist.irecv(buffer, src, group=self._group, tag=tag),
                                      buffer.nbytes))
                    pending += buffer.nbytes
            while in_flight and pending > self._max_in_flight:
                work, size = in_flight.popleft()
                work.wait()
                pending -= size
        for work, _ in in_flight:
            work.wait()
        commits.add_copies(commit, {src % commit.shards: tensors
                                    for src, tensors in received.items()})
        return sent
