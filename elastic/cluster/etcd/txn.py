"""The etcd client's compare-and-swap operations: one transaction each, safe to retry.

A mixin of ``EtcdClient`` (``client``), kept apart so that each module stays one concept:
the client owns the connection, its retries and plain reads and writes; this owns the writes
that are conditional on what etcd holds (create if absent, replace if unchanged, delete if
unchanged) and the member registration that also takes a lease-bound key if nobody holds it
(and may carry one more write of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import aetcd
import aetcd.utils

from elastic.cluster.etcd.values import KeyValue, utf8_keys

T = TypeVar("T")


@dataclass(frozen=True)
class Carried:
    """A key that a registration writes in its own transaction, bound to the same lease, only
    while the key ``unless`` does not exist (a worker's first join request, while the job has
    no round yet)."""

    key: str
    value: str
    unless: str


@dataclass(frozen=True)
class Registration:
    """What ``put_and_claim`` found: the revision of its write, whether it took the claimed
    key, whether it wrote the carried key, and every key under the prefix it read, as of that
    revision (the write included). ``taken``: the key was another's, and nothing was written."""

    revision: int
    claimed: bool
    read: list[KeyValue]
    taken: bool = False
    carried: bool = False


@dataclass(frozen=True)
class Replaced:
    """What ``replace`` did. ``revision``: the mod revision of its write, which the next
    ``replace`` of the key compares against (0: it wrote nothing). When it wrote nothing,
    ``found`` is the key as etcd holds it and ``guard`` the ``held`` key (None: absent, or no
    ``held`` asked), read in the same transaction. An attempt whose reply was lost may have
    written: a retry then finds that write in ``found``."""

    revision: int
    found: KeyValue | None = None
    guard: KeyValue | None = None


class CompareAndSwap:
    """Conditional writes, for a class that runs operations with ``_call`` and reads ``get``."""

    def _call(self, op: Callable[[aetcd.Client], Coroutine[Any, Any, T]], what: str,
              retry_for: timedelta | None = None) -> T:
        raise NotImplementedError

    def get(self, key: str) -> KeyValue | None:
        raise NotImplementedError

    def put_and_claim(self, key: str, value: bytes | str, lease: int,
                      claim: tuple[str, str] | None, read: str,
                      carry: Carried | None = None, beside: str | None = None) -> Registration:
        """Creates ``key`` (bound to ``lease``) if no such key exists, takes ``claim`` = (key,
        value), bound to the same lease, if that key does not exist either, and reads every key
        under ``read``: one transaction, so that a member's registration, its bid to lead and
        its first look at the job's control keys cost one request. ``beside`` is written empty
        with ``key``, bound to the same lease (a member's seat, ``seat.py``). A ``key`` that
        exists is left as it is (``Registration.taken``), unless it holds this very write: retried
        safely, a retry after a lost reply finds its own key and the claimed key holding
        ``claim``'s value (``claim`` lies under ``read``). ``carry`` is written with the key
        when its ``unless`` key does not exist (a retry that finds its own key reports it not
        written, whether the lost attempt wrote it or not).
        """
        data = value.encode() if isinstance(value, str) else value
        raw_key, prefix = key.encode(), read.encode()

        async def txn(c: aetcd.Client) -> tuple[bool, list[Any]]:
            ops = c.transactions
            reads = [ops.get(raw_key),  # the write itself: its revision
                     ops.get(prefix, aetcd.utils.prefix_range_end(prefix))]
            writes = [ops.put(raw_key, data, lease=lease)]
            if beside is not None:
                writes.append(ops.put(beside.encode(), b"", lease=lease))
            if claim is not None:
                writes.append(ops.txn(compare=[ops.create(claim[0].encode()) == 0],
                                      success=[ops.put(claim[0].encode(), claim[1].encode(),
                                                       lease=lease)], failure=[]))
            if carry is not None:  # its answer follows the member key's and the claim's
                writes.append(ops.txn(compare=[ops.create(carry.unless.encode()) == 0],
                                      success=[ops.put(carry.key.encode(), carry.value.encode(),
                                                       lease=lease)], failure=[]))
            return await c.transaction(compare=[ops.create(raw_key) == 0],
                                       success=[*writes, *reads], failure=reads)

        created, responses = self._call(txn, f"register {key}")
        (_, written), = responses[-2]  # either way the key exists: written now, or before
        found = utf8_keys([kv for _, kv in responses[-1]])
        if not created and (written.lease != lease or written.value != data):
            return Registration(revision=0, claimed=False, read=found, taken=True)
        first = 1 if beside is None else 2  # the answer to the first conditional write
        took = created and claim is not None and responses[first].response_txn.succeeded
        claimed = claim is not None and (took or any(
            kv.key == claim[0] and kv.value == claim[1].encode() and kv.lease == lease
            for kv in found))
        carried = created and carry is not None \
            and responses[first + (claim is not None)].response_txn.succeeded
        return Registration(revision=written.mod_revision, claimed=claimed, read=found,
                            carried=carried)

    def delete_if(self, key: str, mod_revision: int) -> bool:
        """Deletes ``key`` only if its mod revision is still ``mod_revision``; returns whether
        this call deleted it."""
        async def txn(c: aetcd.Client) -> bool:
            ok, _ = await c.transaction(
                compare=[c.transactions.mod(key.encode()) == mod_revision],
                success=[c.transactions.delete(key.encode())], failure=[])
            return bool(ok)

        return self._call(txn, f"delete {key} at revision {mod_revision}")
    def create(self, key: str, value: bytes | str, *, also: dict[str, bytes | str] | None = None,
               lease: int | None = None, unchanged: tuple[str, int] | None = None) -> bool:
        """Creates ``key`` (and writes ``also``) only if ``key`` does not exist yet.

        A compare-and-swap: retried safely because a lost reply is resolved by reading back.

        Args:
            key: the key to create.
            value: its value.
            also: keys written in the same transaction.
            lease: the lease ``key`` is bound to.
            unchanged: ``(other_key, mod_revision)``: and only if ``other_key`` still has that
                mod revision (0: still absent).

        Returns:
            True when this call created the key.
        """
        data = value.encode() if isinstance(value, str) else value
        extra = {k: (v.encode() if isinstance(v, str) else v) for k, v in (also or {}).items()}

        async def txn(c: aetcd.Client) -> bool:
            guards = [] if unchanged is None else [
                c.transactions.mod(unchanged[0].encode()) == unchanged[1] if unchanged[1]
                else c.transactions.create(unchanged[0].encode()) == 0]
            ok, _ = await c.transaction(
                compare=[c.transactions.create(key.encode()) == 0, *guards],
                success=[c.transactions.put(key.encode(), data, lease=lease)]
                + [c.transactions.put(k.encode(), v) for k, v in extra.items()],
                failure=[])
            return bool(ok)

        if self._call(txn, f"create {key}"):
            return True
        existing = self.get(key)
        return existing is not None and existing.value == data and existing.lease == (lease or 0)

    def replace(self, key: str, value: bytes | str, mod_revision: int, *,
                clearing: tuple[str, ...] = (), held: tuple[str, int] | None = None) -> Replaced:
        """Writes ``key`` only if its mod revision is still ``mod_revision`` (0: absent).

        Args:
            key: The key to write.
            value: Its new value.
            mod_revision: The mod revision the caller read (0: the key was absent).
            clearing: Prefixes whose other keys are deleted in the same transaction (only if
                the write happens), so that two callers cannot both clear and write.
            held: ``(other_key, mod_revision)``: and only if ``other_key`` still has that mod
                revision (a leader's write, only while the key that makes it leader is its).

        Returns:
            ``Replaced``: the revision written, or what etcd held instead.
        """
        data = value.encode() if isinstance(value, str) else value
        raw_key = key.encode()
        ranges = [r for prefix in clearing for r in _ranges_without(prefix.encode(), [raw_key])]

        async def txn(c: aetcd.Client) -> Replaced:
            ops = c.transactions
            compare = [ops.mod(raw_key) == mod_revision if mod_revision
                       else ops.create(raw_key) == 0]
            reads = [ops.get(raw_key)]
            if held is not None:
                compare.append(ops.mod(held[0].encode()) == held[1])
                reads.append(ops.get(held[0].encode()))
            deletes = [ops.delete(start, range_end=end) for start, end in ranges]
            ok, responses = await c.transaction(
                compare=compare, success=[*deletes, ops.put(raw_key, data), ops.get(raw_key)],
                failure=reads)
            if ok:
                written = _only(responses[-1])
                assert written is not None, "a transaction's get follows its put"
                return Replaced(written.mod_revision)
            return Replaced(0, _only(responses[0]),
                            _only(responses[1]) if held is not None else None)

        return self._call(txn, f"replace {key}")


    def keep_only(self, prefix: str, kept: Sequence[KeyValue], lease: int) -> bool:
        """Deletes every key under ``prefix`` but ``kept``, which it writes again as they were
        read, bound to ``lease``: one transaction, only if none of ``kept`` changed since it was
        read. Returns whether the keys are kept so (a retry after a lost reply finds its own
        writes)."""
        raw = sorted(kv.key.encode() for kv in kept)
        ranges = _ranges_without(prefix.encode(), raw)

        async def txn(c: aetcd.Client) -> bool:
            ops = c.transactions
            ok, _ = await c.transaction(
                compare=[ops.mod(kv.key.encode()) == kv.mod_revision for kv in kept],
                success=[*(ops.delete(start, range_end=end) for start, end in ranges),
                         *(ops.put(kv.key.encode(), kv.value, lease=lease) for kv in kept)],
                failure=[])
            return bool(ok)

        if self._call(txn, f"delete {prefix}* but {len(kept)} keys"):
            return True
        found = [self.get(kv.key) for kv in kept]
        return all(kv is not None and kv.lease == lease for kv in found)


def _only(response: Any) -> KeyValue | None:
    """The one key of a transaction's get of one key (None: absent)."""
    found = utf8_keys([kv for _, kv in response])
    return found[0] if found else None


def _ranges_without(prefix: bytes, keys: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
    """The key ranges of ``prefix`` minus ``keys`` themselves (sorted; etcd refuses a
    transaction that deletes and puts the same key)."""
    ranges, start = [], prefix
    for key in sorted(k for k in keys if k.startswith(prefix)):
        if start < key:
            ranges.append((start, key))
        start = key + b"\0"
    end = aetcd.utils.prefix_range_end(prefix)
    return ranges + [(start, end)] if start < end else ranges
