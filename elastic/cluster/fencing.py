"""The job's fencing epoch in etcd: the high part of every durable checkpoint's generation.

Owns the one key ``JobKeys.fence`` and how it is claimed; knows nothing of checkpoints (the
floor comes from the caller, who read it off the checkpoint URL).
"""

from __future__ import annotations

import logging

from elastic.cluster.etcd_client import EtcdClient

log = logging.getLogger(__name__)


def claim_fencing_epoch(client: EtcdClient, key: str, floor: int) -> int:
    """The job's fencing epoch in this etcd: claimed once as ``floor`` (create-if-absent),
    then the same for every member and every round for as long as the etcd keeps its data.

    Args:
        client: the job's etcd.
        key: the job's fence key.
        floor: the epoch to claim when this etcd holds none yet (one above every epoch the
            checkpoint URL has seen, so a fresh etcd or a new job id never goes backwards).

    Raises:
        EtcdUnavailableError: etcd stayed unreachable past the retry deadline.
    """
    existing = client.get(key)
    if existing is None:
        if client.create(key, str(floor)):
            return floor
        existing = client.get(key)  # another member created it first
    text = existing.value.decode(errors="replace") if existing is not None else ""
    if text.isdigit() and int(text) > 0:
        return int(text)
    log.warning("the fencing epoch at %s was missing or malformed (%r); claiming %d",
                key, text[:40], floor)
    client.put(key, str(floor))
    return floor
