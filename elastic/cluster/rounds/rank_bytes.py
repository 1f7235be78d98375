"""The job's ``bytes_per_rank`` record: how many bytes of host memory one rank's live sharded
state took at the newest formation, so that a joiner can touch that much memory ahead
(``warm_memory``) before it asks to join.

Rank 0 writes it after each formation of a sharded job, on a thread (training never waits for
etcd for it), and only when the figure changed; the newest figure is the one left written. A
worker reads it once, before it first asks to join (a joiner; or every worker of a job started
again under the same id, which then loads state of about that size). It is a hint: a missing or malformed record (anyone who can write the job's prefix
can write it) is ignored with a warning, and what a joiner touches is capped by the memory its
machine has free.
"""

from __future__ import annotations

import json
import logging
import threading

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds import records
from elastic.cluster.rounds.keys import JobKeys
from elastic.foundation.errors import EtcdAccessError, EtcdUnavailableError

log = logging.getLogger(__name__)

MAX_BYTES = 2**50  # 1 PiB: far above any one rank's host memory


def parse(raw: bytes) -> int:
    """The bytes a ``bytes_per_rank`` record holds.

    Raises:
        RecordError: not ``{"bytes": n}`` with an integer n in ``[0, MAX_BYTES]``.
    """
    data = records.load_object(raw, {"bytes": True})
    return records.integer("bytes", data["bytes"], 0, MAX_BYTES)


class RankBytes:
    """Writes and reads one job's ``bytes_per_rank`` record."""

    def __init__(self, client: EtcdClient, keys: JobKeys) -> None:
        self._client = client
        self._key = keys.bytes_per_rank
        self._published: int | None = None  # the newest figure given to ``publish``
        self._writing = threading.Lock()  # one write at a time, each of the newest figure

    def publish(self, nbytes: int) -> threading.Thread | None:
        """Writes ``nbytes`` on a daemon thread unless it was the last figure written; returns
        the thread (None when nothing is written)."""
        if nbytes == self._published:
            return None
        self._published = nbytes
        thread = threading.Thread(target=self._put, daemon=True, name="elastic-rank-bytes")
        thread.start()
        return thread

    def _put(self) -> None:
        with self._writing:
            try:
                self._client.put(self._key, json.dumps({"bytes": self._published}))
            except (EtcdUnavailableError, EtcdAccessError) as exc:  # unreachable, or full
                log.warning("could not record one rank's state size in etcd: %s", exc)

    def read(self) -> int | None:
        """The bytes recorded, or None when there is no record, it is malformed or etcd could
        not be read (warned)."""
        try:
            kv = self._client.get(self._key)
        except (EtcdUnavailableError, EtcdAccessError) as exc:
            log.warning("could not read %s (%s): joiners touch no memory ahead", self._key, exc)
            return None
        if kv is None:
            return None
        try:
            return parse(kv.value)
        except records.RecordError as exc:
            log.warning("ignored the record %s (%s): joiners touch no memory ahead", self._key,
                        exc)
            return None
