"""The values the etcd client hands out (keys, watch events) and how raw aetcd replies become
them: keys that are not UTF-8 are skipped with a warning, and a watch callback's failure is
logged rather than raised into the watch. Knows aetcd's reply shapes, nothing of jobs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aetcd
import aetcd.rpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyValue:
    """One key as read from etcd."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch: ``kind`` is "put" or "delete"."""

    kind: str
    key: str
    value: bytes
    revision: int
    lease: int = 0
    create_revision: int = 0


def kv_of(kv: Any) -> KeyValue:
    return KeyValue(key=kv.key.decode(), value=bytes(kv.value), mod_revision=kv.mod_revision,
                    create_revision=kv.create_revision, lease=kv.lease)


def utf8_keys(kvs: Any) -> list[KeyValue]:
    """The keys of a range read, without those that are not UTF-8 (each skipped with a
    warning: nothing of ours writes them)."""
    read = []
    for raw in kvs:
        try:
            read.append(kv_of(aetcd.KeyValue(raw)))
        except UnicodeDecodeError:
            log.warning("skipping etcd key %r: not UTF-8 (nothing of ours writes it)",
                        bytes(raw.key)[:80])
    return read


def event_of(event: Any) -> WatchEvent:
    """The event of etcd's protobuf ``mvccpb.Event``."""
    kind = "delete" if event.type == aetcd.rpc.Event.DELETE else "put"
    return WatchEvent(kind=kind, key=event.kv.key.decode(), value=bytes(event.kv.value),
                      revision=event.kv.mod_revision, lease=event.kv.lease,
                      create_revision=event.kv.create_revision)


def deliver(events: list[Any], callback: Callable[[list[WatchEvent]], None]) -> None:
    """Hands the events of one watch answer to a watch's callback, one at a time (a listener
    that fails on one still gets the next); nothing either does can end the watch."""
    for event in events:
        try:
            seen = event_of(event)
        except UnicodeDecodeError:
            log.warning("skipping etcd key %r: not UTF-8 (nothing of ours writes it)",
                        bytes(event.kv.key)[:80])
            continue
        try:
            callback([seen])
        except Exception as exc:  # noqa: BLE001 (a listener's bug must not blind the member)
            log.warning("a listener failed on %s %s (%s: %s); the watch goes on", seen.kind,
                        seen.key, type(exc).__name__, exc)
