"""Where a round's agreement channel is published: one etcd key under the job's prefix.

The record (rank 0's channel address and the round's secret) grants admission to the channel,
so it lives only where etcd's credentials guard it, never in the round's TCPStore (which anyone
who reaches rank 0's store port can read and write). Rank 0 writes it before it hosts the
round's store; the others read it once they have formed the group on that store, so that one
read finds it (etcd orders the two writes, and its reads are linearizable). It must not decide
what the record says (``admission`` does).
"""

from __future__ import annotations

from datetime import timedelta

from elastic.cluster.etcd.client import EtcdClient


class ChannelBook:
    """The agreement channel's record of one round, in etcd.

    Args:
        client: the worker's etcd client.
        key: the round's channel key (``JobKeys.channel``).
    """

    def __init__(self, client: EtcdClient, key: str) -> None:
        self._client = client
        self._key = key

    def publish(self, record: str) -> None:
        """Writes rank 0's record (once per round)."""
        self._client.put(self._key, record)

    def find(self, timeout: timedelta) -> bytes:
        """Reads rank 0's record; ``timeout`` is not needed: it was written before the round's
        store, which this rank has reached.

        Raises:
            RuntimeError: nothing is published (something deleted the round's keys): the round
                cannot form, and the run loop re-forms.
        """
        del timeout
        kv = self._client.get(self._key)
        if kv is None:
            raise RuntimeError(f"rank 0's agreement channel is not published at {self._key}; "
                               f"the round's keys were deleted while it formed")
        return kv.value
