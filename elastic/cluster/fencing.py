"""The job's fencing epoch in etcd: the high part of every durable checkpoint's generation.

Owns the one key ``JobKeys.fence`` and how it is claimed; knows nothing of checkpoints (the
floor comes from the caller, who read it off the checkpoint URL).
"""

from __future__ import annotations

import logging

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.etcd.values import KeyValue
from elastic.foundation.errors import FencingContestedError

log = logging.getLogger(__name__)


#: How many times a claim reads and writes again after another member's write won the race:
#: each lost race means the key rose, so a few suffice; a bound on a race, not a timeout.
_CLAIM_ATTEMPTS = 16


def claim_fencing_epoch(client: EtcdClient, key: str, floor: int) -> int:
    """The job's fencing epoch in this etcd, at least ``floor``: ``max(existing, floor)``,
    written by compare-and-swap, so that it only ever grows and every member ends on the same
    value for as long as the etcd keeps its data.

    Args:
        client: the job's etcd.
        key: the job's fence key.
        floor: one above every epoch the checkpoint URL has seen, so that a fresh etcd, a new
            job id, or a persistent etcd whose job id was used before never goes backwards.

    Raises:
        EtcdUnavailableError: etcd stayed unreachable past the retry deadline.
        FencingContestedError: the key kept changing under this claim (``_CLAIM_ATTEMPTS``
            races lost in a row).
    """
    existing = client.get(key)
    for _ in range(_CLAIM_ATTEMPTS):
        current = _epoch_of(existing)
        if current is not None and current >= floor:
            return current
        if existing is not None and current is None:
            log.warning("the fencing epoch at %s was malformed (%r); claiming %d", key,
                        existing.value[:40], floor)
        written = client.replace(key, str(floor), existing.mod_revision if existing else 0)
        if written.revision:
            return floor
        existing = written.found  # another member wrote first: compare again
    raise FencingContestedError(
        f"the fencing epoch at {key} changed {_CLAIM_ATTEMPTS} times while this member claimed "
        f"{floor}: something other than this job's members writes that key. Stop it, or give "
        "the job its own --job-id.")


def _epoch_of(kv: KeyValue | None) -> int | None:
    """The epoch a fence key holds (None: absent or malformed)."""
    text = kv.value.decode(errors="replace") if kv is not None else ""
    return int(text) if text.isdigit() and int(text) > 0 else None
