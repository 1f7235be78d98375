"""Pure rendezvous logic: when a round may close, and who gets which rank. No I/O, no clock.

Kept apart from ``rendezvous.py`` so that it is tested without etcd.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

log = logging.getLogger(__name__)

REASONS = ("start", "change", "failure", "spare")
_MAX_VERSION = 2**63 - 1


@dataclass(frozen=True)
class JoinRequest:
    """A member's request to be in a round.

    ``reason`` is one of "start" (a new process), "change" (a running member at an agreed
    re-formation), "failure" (a running member whose group broke), "spare" (a member left out by
    ``max_workers`` asking again).
    """

    member_id: str
    version: int
    reason: str
    addr: str
    port: int
    revision: int = 0

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("revision")
        return json.dumps(data)

    @staticmethod
    def from_json(raw: bytes, revision: int, member_id: str | None = None) -> "JoinRequest":
        """Reads a join record, checking every field's type and range.

        Args:
            raw: the value read from etcd.
            revision: its create revision.
            member_id: the member its key names, which the record must name too.

        Raises:
            ValueError: the record is not one a member writes.
        """
        try:
            data: Any = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not JSON ({exc})") from None
        expected = {f.name for f in fields(JoinRequest)} - {"revision"}
        if not isinstance(data, dict) or set(data) != expected:
            raise ValueError(f"fields are not {sorted(expected)}")
        if not isinstance(data["member_id"], str) or not data["member_id"] or (
                member_id is not None and data["member_id"] != member_id):
            raise ValueError("member_id does not match the key")
        for name, top in (("version", _MAX_VERSION), ("port", 65535)):
            value = data[name]
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
                raise ValueError(f"{name} is not an integer in [0, {top}]")
        if data["reason"] not in REASONS or not isinstance(data["addr"], str):
            raise ValueError("reason or addr is malformed")
        return JoinRequest(revision=revision, **data)


def valid_joins(records: Iterable[tuple[str, bytes, int]]) -> list[JoinRequest]:
    """The well-formed join records among ``(key, value, revision)``; each malformed one is
    skipped with one warning naming its key."""
    requests = []
    for key, raw, revision in records:
        try:
            requests.append(JoinRequest.from_json(raw, revision, key.rsplit("/", 1)[-1]))
        except ValueError as exc:
            log.warning("skipping the malformed join record %s: %s", key, exc)
    return requests


@dataclass(frozen=True)
class Plan:
    """The agreed world of one round: ``ranks[i]`` is the member with rank i."""

    round: int
    ranks: list[str]
    spares: list[str] = field(default_factory=list)
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    versions: dict[str, int] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(raw: bytes) -> "Plan":
        return Plan(**json.loads(raw))


@dataclass(frozen=True)
class CloseRule:
    """When a round may close."""

    min_workers: int
    max_workers: int | None
    settle_s: float


def should_close(requests: list[JoinRequest], live: set[str], has_previous: bool,
                 quiet_s: float, rule: CloseRule) -> bool:
    """Decides whether the round with these join requests may close now.

    Args:
        requests: the round's join requests.
        live: the ids of every registered (lease-holding) member.
        has_previous: whether an earlier round formed (this is a re-formation).
        quiet_s: seconds since the requests or the live set last changed.
        rule: the job's limits.
    """
    joined = {r.member_id for r in requests}
    if len(joined) < rule.min_workers:
        return False
    complete = live <= joined
    full = rule.max_workers is not None and len(joined) >= rule.max_workers
    settled = quiet_s >= rule.settle_s
    if complete and (has_previous or full or settled):
        return True
    # Survivors of a failure need not wait for a dead member's lease to run out.
    return settled and any(r.reason == "failure" for r in requests)


def assign_ranks(requests: list[JoinRequest], previous: list[str], round_: int,
                 max_workers: int | None) -> Plan:
    """Orders the requests into ranks: the newest commit first (it becomes rank 0, the source of
    the state), then members of the previous round in their old order, then by arrival.
    Members beyond ``max_workers`` become spares.
    """
    if not requests:
        raise ValueError("A round needs at least one join request.")
    old_rank = {member: i for i, member in enumerate(previous)}
    ordered = sorted(requests, key=lambda r: (-r.version, old_rank.get(r.member_id, len(previous)),
                                              r.revision, r.member_id))
    cut = len(ordered) if max_workers is None else max_workers
    chosen, spares = ordered[:cut], ordered[cut:]
    return Plan(round=round_, ranks=[r.member_id for r in chosen],
                spares=[r.member_id for r in spares], master_addr=chosen[0].addr,
                master_port=chosen[0].port, versions={r.member_id: r.version for r in requests})
