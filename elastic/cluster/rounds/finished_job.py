"""What a finished job leaves on its etcd (a user's, shared with other jobs): the few keys that
say it finished, bound to a lease.

The member that leaves a finished job last (no member key is left) deletes every key under the
job's prefix but those that say the job is over: the news, the ``round`` counter and the done
marks of that round. It writes them again as it found them, bound to a fresh lease of
``Timeouts.finished_marker``: one transaction, only if none changed since it read them. Within
that time a worker that comes later reads the news at its registration, as every member does,
and is told the job finished (``RendezvousClosedError``; the counter keeps its registration
from asking for a job's first round), and a launcher learns that its worker that failed after
returning had finished (``JoinedWorkers.has_finished``), as when every key was still there;
after it the job id is free again. Of two members leaving at once, at least the later one sees
the other gone (etcd orders their writes and reads), and only one of them writes the keys.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from elastic.cluster.rounds import records
from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys

log = logging.getLogger(__name__)


def clear_finished_job(client: EtcdClient, keys: JobKeys, marker_ttl: timedelta) -> bool:
    """Leaves only what says the finished job is over, under a lease of ``marker_ttl``, when no
    member of the job is left; returns whether it did.

    Raises:
        EtcdUnavailableError: etcd could not be reached.
        EtcdRecordError: the round counter is not a round number.
    """
    members, _ = client.get_prefix(keys.members)
    if members:
        return False  # the last to leave clears
    counter = client.get(keys.round)
    kept = [kv for kv in (client.get(keys.news), counter) if kv is not None]
    if counter is not None:
        dones, _ = client.get_prefix(keys.dones(records.round_number(keys.round,
                                                                     counter.value)))
        kept += dones
    lease = client.grant(marker_ttl)
    if client.keep_only(keys.prefix, kept, lease):
        log.info("deleted the finished job's keys under %s but %d, which stay for %s",
                 keys.prefix, len(kept), marker_ttl)
        return True
    client.revoke(lease)  # they changed meanwhile: another member left last after all
    return False
