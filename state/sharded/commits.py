"""The sharded commits a rank keeps in host memory, and which one a new formation rebuilds.

A ``ShardCommit`` is one version of the sharded state in one layout: this rank's own shard
(copied at the commit) and the shards of the ranks it is a buddy of (received afterwards, in the
background). ``ShardCommits`` keeps the newest two and, besides them, the newest commit known to
be whole (its buddy copies held by every rank: a single loss takes no shard of it), so that the
last such rollback point survives until a newer one is whole, and the commit the last formation
rebuilt until its new layout is whole. A formation that rebuilds a commit
in its own layout (N -> N) commits it under the same key: the new commit borrows the shards the
old one held (shard ``s`` of one key is the same bytes whoever holds it) until it is whole
itself. At a formation every rank
reports what it holds as a row of ints (``report``; no pickling; as long as its holdings need,
however many shards the layout puts on it, padded to the longest row before they are gathered)
and all rows choose the same commit: the newest version whose every shard has a live holder
(``choose``). The shards of
the commits it drops go back to ``buffers`` for the next commits (see ``buffers``). Torch only.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.state.sharded.buffers import ShardBuffers
from elastic.state.sharded.layout import ShardLostError, TensorSpec

KEEP = 2  # the newest commit and the one before it
_HEAD = 5  # version, world, shards, own shard, count of held shards


@dataclass
class ShardCommit:
    """One version of the sharded state in one layout, as this rank holds it.

    ``held`` maps a shard index to its tensors (flat name -> that shard's rows, on host);
    ``small`` is the rest of the commit (``TrainState.committed()`` copied), so that a
    rollback to this version restores the sampler and plain values with it. A ``live`` commit
    (the copy-free commit) holds the live local tensors themselves, valid until the next step
    is applied, when the next live commit replaces it; ``frozen`` once its objects are
    dropped (a re-formation), when nothing steps those tensors again and it is kept like a
    copied commit, though its tensors, a model's memory, are never reused. ``whole``: every
    rank of its layout is known to hold its buddies' copies of it (``ShardCommits.confirm``).
    ``in_flight``: its buddy exchange started and has not ended well (a failed one never
    does), so its shards may still be read or written by a send or receive and are never
    reused. ``borrowed``: the shards of ``held`` taken from the commit of the same key that
    this one replaced, held until this one is whole. ``rebuilt``: the commit the last
    formation chose, kept until a commit of its version or a newer one is whole.
    """

    version: int
    world: int
    shards: int
    own: int
    specs: Mapping[str, TensorSpec]
    small: Mapping[str, Any]
    held: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    live: bool = False
    frozen: bool = False
    whole: bool = False
    in_flight: bool = False
    borrowed: set[int] = field(default_factory=set)
    rebuilt: bool = False

    @property
    def key(self) -> tuple[int, int, int]:
        return self.version, self.world, self.shards


@dataclass(frozen=True)
class Holding:
    """What one rank reported holding of one commit."""

    version: int
    world: int
    shards: int
    own: int
    held: frozenset[int]

    @property
    def key(self) -> tuple[int, int, int]:
        return self.version, self.world, self.shards


@dataclass(frozen=True)
class Choice:
    """The commit a formation rebuilds: its key, each shard's holders (ranks of the new round),
    whether a rank that trained on each shard lives, and for each rank of the new round the
    shard it trained on in that commit (None: a rank new to its layout)."""

    version: int
    world: int
    shards: int
    holders: tuple[frozenset[int], ...]
    owners_alive: tuple[bool, ...]
    own: tuple[int | None, ...] = ()


class ShardCommits:
    """The newest ``KEEP`` sharded commits of this rank, its newest whole one and the one the
    last formation rebuilt; safe to add copies from a thread.

    Args:
        max_held: the shards one rank holds of a commit (its own and its buddies'), kept for
            reuse at first; more when some kept commit holds more (uneven nodes).
    """

    def __init__(self, max_held: int) -> None:
        self._lock = threading.Lock()
        self._commits: list[ShardCommit] = []
        self.buffers = ShardBuffers(limit=max_held)

    def add(self, commit: ShardCommit) -> None:
        """Keeps ``commit`` as the newest; commits newer than it or of its version and layout
        (an abandoned future, rolled back), any live commit (valid only while it is the newest:
        its tensors move on with the next step) and all but the newest ``KEEP`` go, except the
        newest whole commit (it stays until a newer one is whole) and the one a formation
        rebuilt (``rebuilding``). The same version in another
        layout stays: a formation commits the version it resharded in the new layout, whose
        buddy copies then travel while the old layout still holds it. In the same layout (a
        replacement took a dead rank's place) ``commit`` borrows the held shards of the one it
        replaces, every one of them: its own copies travel still, and a second failure
        meanwhile must find the first one's holders."""
        with self._lock:
            same = next((c for c in self._commits if c.key == commit.key and not c.live), None)
            if same is not None:
                _borrow(commit, same)
            kept = [c for c in self._commits if not c.live and (
                c.version < commit.version or (c.version == commit.version
                                               and c.key != commit.key))]
            self._keep(_trimmed(kept + [commit]))

    def confirm(self, commit: ShardCommit) -> None:
        """Marks ``commit`` whole (every rank waited for its buddy copies before an agreement
        that every rank reached); the whole commit before it, and the shards it borrowed, may
        go now."""
        with self._lock:
            commit.whole = True
            for shard in commit.borrowed:
                del commit.held[shard]
            commit.borrowed.clear()
            for kept in self._commits:
                if kept.rebuilt and kept.version <= commit.version and kept is not commit:
                    kept.rebuilt = False
            self._keep(_trimmed(self._commits))

    def freeze(self) -> None:
        """The live objects are dropped: a live commit whose shards are in host memory is kept
        from now on like a copied one (a formation's reshard may read it, and after the
        formation it is the old layout's copy of its version). One on a GPU still goes with
        the next commit: keeping it would hold a second layout's shards on the device."""
        with self._lock:
            for commit in self._commits:
                if commit.live and all(t.device.type == "cpu" for shard in commit.held.values()
                                       for t in shard.values()):
                    commit.live, commit.frozen = False, True

    def sending(self, commit: ShardCommit) -> None:
        """``commit``'s buddy exchange starts: its shards are not reused until it ends well."""
        with self._lock:
            commit.in_flight = True

    def hold(self, commit: ShardCommit, shards: dict[int, dict[str, torch.Tensor]]) -> None:
        """Records shards of ``commit`` copied after it was added (its own, copied off the
        training thread); a shard it had borrowed is its own now (kept once it is whole)."""
        with self._lock:
            _hold(commit, shards)

    def add_copies(self, commit: ShardCommit, copies: dict[int, dict[str, torch.Tensor]]
                   ) -> None:
        """Records the buddies' shards of ``commit`` once all of them arrived: its exchange
        ended well."""
        with self._lock:
            _hold(commit, copies)
            commit.in_flight = False

    def rebuilding(self, key: tuple[int, int, int]) -> None:
        """A formation chose the commit of ``key`` (``choose``): the commits newer than its
        version go, and so do its version's other layouts that are not whole (a formation
        before this one committed them; their copies did not all land). It stays, whatever
        the count, until a commit of its version in the new layout, or a newer one, is whole:
        two formations in a row must not trim the one that every rank can still rebuild."""
        version = key[0]
        with self._lock:
            kept = [c for c in self._commits if c.version < version or c.key == key
                    or (c.version == version and c.whole)]
            for commit in kept:
                commit.rebuilt = commit.key == key
            self._keep(kept)

    def _keep(self, commits: list[ShardCommit]) -> None:
        """Keeps ``commits``; the shards of those that go are reused unless their exchange is
        in flight (or failed). A live or frozen commit's tensors are a model's: never
        reused."""
        self.buffers.keep_at_least(max((len(c.held) for c in commits), default=0))
        kept = {id(tensors) for c in commits for tensors in c.held.values()}
        for dropped in self._commits:
            if not (dropped.live or dropped.frozen or dropped.in_flight
                    or any(c is dropped for c in commits)):
                for tensors in dropped.held.values():
                    if id(tensors) not in kept:
                        self.buffers.give(tensors)
        self._commits = commits

    def find(self, key: tuple[int, int, int]) -> ShardCommit | None:
        with self._lock:
            return next((c for c in self._commits if c.key == key), None)

    def report(self, width: int = 0) -> torch.Tensor:
        """This rank's holdings as one int64 row: per commit its key, own shard, the count of
        the shards it holds and those shards; every held shard, whatever the layout put on
        this rank. ``-1`` pads it to ``width`` when that is longer (rows of one all-gather
        must be as long as the longest)."""
        values: list[int] = []
        with self._lock:
            for commit in self._commits:
                held = sorted(commit.held)
                values += [commit.version, commit.world, commit.shards, commit.own, len(held),
                           *held]
        return torch.tensor(values + [-1] * (width - len(values)), dtype=torch.int64)


def _hold(commit: ShardCommit, shards: dict[int, dict[str, torch.Tensor]]) -> None:
    commit.held.update(shards)
    commit.borrowed.difference_update(shards)  # borrowed no more: its own now


def _borrow(commit: ShardCommit, same: ShardCommit) -> None:
    """Lends ``commit`` every shard that ``same`` (of its key) holds and it does not, however
    many the layout put on this rank (at most one per shard of the layout)."""
    for shard in sorted(same.held):
        if shard not in commit.held:
            commit.held[shard] = same.held[shard]
            commit.borrowed.add(shard)


def _trimmed(commits: list[ShardCommit]) -> list[ShardCommit]:
    """The newest ``KEEP`` of ``commits`` (oldest first), preceded by the newest whole one and
    the one a formation rebuilt when they are older than those: a rank never drops its last
    whole commit before a newer one is, nor the commit rebuilt before its new layout is."""
    newest = commits[-KEEP:]
    whole = next((c for c in reversed(commits) if c.whole), None)
    return [c for c in commits[:-KEEP] if c is whole or c.rebuilt] + newest


def read_report(row: Sequence[int]) -> list[Holding]:
    """Decodes one rank's report row (from ``ShardCommits.report``, padded or not)."""
    found, at = [], 0
    while at + _HEAD <= len(row) and int(row[at]) >= 0:
        version, world, shards, own, count = (int(v) for v in row[at: at + _HEAD])
        held = [int(v) for v in row[at + _HEAD: at + _HEAD + count]]
        assert shards >= 1 and count == len(held), f"a malformed report row: {list(row)}"
        found.append(Holding(version, world, shards, own, frozenset(held)))
        at += _HEAD + count
    return found


def choose(reports: Sequence[Sequence[Holding]]) -> Choice | None:
    """The newest commit whose every shard some rank of the new round holds; None when no
    rank holds any (a fresh start).

    Raises:
        ShardLostError: ranks hold commits, but none of them wholly.
    """
    keys = sorted({h.key for rows in reports for h in rows}, reverse=True)
    for version, world, shards in keys:
        holders: list[set[int]] = [set() for _ in range(shards)]
        alive = [False] * shards
        own: list[int | None] = [None] * len(reports)
        for rank, rows in enumerate(reports):
            for h in rows:
                if h.key == (version, world, shards):
                    alive[h.own] = True
                    own[rank] = h.own
                    for shard in h.held:
                        holders[shard].add(rank)
        if all(holders):
            return Choice(version, world, shards, tuple(frozenset(h) for h in holders),
                          tuple(alive), tuple(own))
    if keys:
        version, world, shards = keys[0]
        raise ShardLostError(f"no live rank holds every shard of any kept commit (newest: "
                             f"version {version}, {shards} shards over {world} ranks): the "
                             "ranks that held some shard all died together.")
    return None
