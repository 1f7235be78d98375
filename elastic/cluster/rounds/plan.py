"""Pure rendezvous logic: when a round may close, and who gets which rank. No I/O, no clock.

Kept apart from ``rendezvous.py`` so that it is tested without etcd. Join requests and plans
are read back through ``records``' checks: a field of the wrong type or out of range is a
``RecordError``, never a value used.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from elastic.cluster.rounds import records
from elastic.cluster.rounds.places import in_proportion
from elastic.cluster.rounds.records import MAX_ROUND, MAX_VERSION, RecordError
from elastic.foundation.timeouts import Timeouts

REASONS = frozenset({"start", "change", "failure", "spare"})
_JOIN_FIELDS = {"member_id": True, "version": True, "reason": True, "addr": True, "port": True,
                "standby": False, "from_round": False, "from_world": False, "node": False,
                "node_workers": False}
_MAX_WORLD = 10**7
_PLAN_FIELDS = {"round": True, "ranks": True, "spares": False, "master_addr": False,
                "master_port": False, "versions": False, "cut": False, "target": False}


@dataclass(frozen=True)
class JoinRequest:
    """A member's request to be in a round.

    ``reason`` is one of "start" (a new process), "change" (a running member at an agreed
    re-formation), "failure" (a running member whose group broke), "spare" (a member left out by
    ``max_workers`` asking again, a new process while the world is at ``max_workers``, or a
    warm spare; not news: the running members do not re-form for it). ``standby`` marks a
    warm spare (``elastic run --spares``): it takes a place in a round only when a member of
    the previous round is gone, never to grow the world. ``from_round`` and ``from_world`` name the round this
    process was last in and its world size (0: none), so that a first round after etcd lost
    its rounds waits for the old world (``roll_call.returning_short``). ``node`` names the
    launcher that started this member and ``node_workers`` how many workers it started (""
    and 0 for a worker started by hand): a job's first round waits for all of them
    (``should_close``).
    """

    member_id: str
    version: int
    reason: str
    addr: str
    port: int
    revision: int = 0
    standby: bool = False
    from_round: int = 0
    from_world: int = 0
    node: str = ""
    node_workers: int = 0

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("revision")
        return json.dumps(data)

    @staticmethod
    def from_json(raw: bytes, revision: int, key_member: str) -> "JoinRequest":
        """Reads a join request stored under ``.../join/{key_member}``.

        Raises:
            RecordError: a field is missing, unknown, of the wrong type or out of range, or the
                member id differs from the key's.
        """
        data = records.load_object(raw, _JOIN_FIELDS)
        member = records.member_id("member_id", data["member_id"])
        if member != key_member:
            raise RecordError(f"member_id {member!r} differs from the key's {key_member!r}")
        return JoinRequest(member_id=member,
                           version=records.integer("version", data["version"], 0, MAX_VERSION),
                           reason=records.one_of("reason", data["reason"], REASONS),
                           addr=records.address("addr", data["addr"]),
                           port=records.integer("port", data["port"], 1, 65535),
                           revision=revision,
                           standby=records.boolean("standby", data.get("standby", False)),
                           from_round=records.integer("from_round", data.get("from_round", 0), 0,
                                                      records.MAX_ROUND),
                           from_world=records.integer("from_world", data.get("from_world", 0), 0,
                                                      _MAX_WORLD),
                           node=records.member_id("node", data["node"]) if data.get("node")
                           else "",
                           node_workers=records.integer("node_workers",
                                                        data.get("node_workers", 0), 0,
                                                        _MAX_WORLD))


@dataclass(frozen=True)
class Plan:
    """The agreed world of one round: ``ranks[i]`` is the member with rank i."""

    round: int
    ranks: list[str]
    spares: list[str] = field(default_factory=list)
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    versions: dict[str, int] = field(default_factory=dict)
    cut: list[str] = field(default_factory=list)  # left out, maybe alive: cut off
    target: int = 0  # the world warm spares fill back to (0: this round's world)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_full(self) -> bool:
        """Whether the world is at its target: a warm spare has no place to fill."""
        return self.world_size >= self.target

    def to_json(self) -> str:
        """The stored form: ``versions`` as a list in the order of ``ranks`` then ``spares``
        (the ids are not written twice: a 1,000-member plan is half the size)."""
        data = asdict(self)
        if self.versions:
            data["versions"] = [self.versions.get(m, 0) for m in self.ranks + self.spares]
        else:
            del data["versions"]
        return json.dumps(data)

    @staticmethod
    def from_json(raw: bytes, round_: int) -> "Plan":
        """Reads the plan of round ``round_``.

        Raises:
            RecordError: a field is missing, unknown, of the wrong type or out of range.
        """
        data = records.load_object(raw, _PLAN_FIELDS)
        if records.integer("round", data["round"], 1, MAX_ROUND) != round_:
            raise RecordError(f"round is {data['round']}, in the key of round {round_}")
        ranks = _member_list("ranks", data["ranks"], minimum=1)
        spares = _member_list("spares", data.get("spares", []), minimum=0)
        cut = _member_list("cut", data.get("cut", []), minimum=0)
        versions = _versions(data.get("versions", []), ranks + spares)
        return Plan(round=round_, ranks=ranks, spares=spares,
                    master_addr=records.address("master_addr",
                                                data.get("master_addr", "127.0.0.1")),
                    master_port=records.integer("master_port", data.get("master_port", 0), 0,
                                                65535),
                    versions=versions, cut=cut,
                    target=records.integer("target", data.get("target", 0), 0, _MAX_WORLD))


def _versions(value: object, members: list[str]) -> dict[str, int]:
    """The versions of a stored plan: a list in the order of ``members`` (none: no versions),
    or an object by member id (as plans were once stored)."""
    if type(value) is dict:
        records.member_ids("a member of versions", list(value))
        pairs = list(value.items())
    elif type(value) is list and len(value) in (0, len(members)):
        pairs = list(zip(members, value))
    else:
        raise RecordError(f"versions is not a list of {len(members)} versions, one for each "
                          "member of ranks and spares")
    for member, version in pairs:
        if type(version) is not int or not 0 <= version <= MAX_VERSION:  # a message, once
            records.integer(f"the version of {member}", version, 0, MAX_VERSION)
    return dict(pairs)


def _member_list(name: str, value: object, minimum: int) -> list[str]:
    if type(value) is not list or len(value) < minimum:
        raise RecordError(f"{name} is not a list of at least {minimum} member ids")
    members = records.member_ids(f"an entry of {name}", value)
    if len(set(members)) != len(members):
        raise RecordError(f"{name} names a member twice")
    return members


@dataclass(frozen=True)
class RendezvousConfig:
    """Limits of a job's rounds; the waits come from the job's ``Timeouts``."""

    min_workers: int = 1
    max_workers: int | None = None
    timeouts: Timeouts = Timeouts()
    standby: bool = False  # this member is a warm spare (``elastic run --spares``)
    node: str = ""  # the launcher that started this member (``JoinRequest.node``)
    node_workers: int = 0  # how many workers that launcher started (0: unknown)
    sharded: bool = False  # the job's state is sharded in rank order (``places``)
    shard_degree: int | None = None  # its HSDP shard degree (None: FSDP over every rank)

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_workers ({self.min_workers}) must be >= 1.")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) must be >= min_workers "
                             f"({self.min_workers}).")


@dataclass(frozen=True)
class CloseRule:
    """When a round may close."""

    min_workers: int
    max_workers: int | None
    settle_s: float
    local_start_s: float = 0.0  # how long a first round waits for a launcher's workers


def has_nodes_short(requests: list[JoinRequest]) -> bool:
    """Whether a launcher named in ``requests`` started more workers than have asked (warm
    spares apart): the rest are still starting (importing torch, say)."""
    asked: dict[str, int] = {}
    expected: dict[str, int] = {}
    for request in requests:
        if request.node and not request.standby:
            asked[request.node] = asked.get(request.node, 0) + 1
            expected[request.node] = max(expected.get(request.node, 0), request.node_workers)
    return any(asked[node] < expected[node] for node in asked)


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
    core = sum(not r.standby for r in requests)
    full = rule.max_workers is not None and core >= rule.max_workers
    # A first round also waits for every worker the launchers named in it started, as long as
    # something changes within ``local_start_s``: under load a node's workers reach ``run()``
    # seconds apart, more than the settle window.
    wait_s = rule.settle_s if has_previous or not has_nodes_short(requests) \
        else max(rule.settle_s, rule.local_start_s)
    settled = quiet_s >= wait_s
    # A re-formation has its own rule (``roll_call.may_close``): a window passing never leaves
    # out a member of the last round.
    return complete and (has_previous or full or settled)


def assign_ranks(requests: list[JoinRequest], previous: list[str], round_: int,
                 max_workers: int | None, min_workers: int = 1, target: int = 0,
                 config: RendezvousConfig | None = None) -> Plan:
    """Orders the requests into ranks: the newest commit first (it becomes rank 0, the source of
    the state), then members of the previous round in their old order, then by arrival. In a
    sharded job (``config.sharded``) on one host, newcomers then move in between the previous
    round's members so that those keep their slices of the state (``places.in_proportion``: a
    reshard then moves little more than the newcomers' shards); across hosts the order stays,
    so that each host's ranks stay together.
    Members beyond ``max_workers`` become spares. A warm spare (``standby``) that was not in the
    previous round is taken only to fill the world back to the previous round's ``target`` (the
    largest world the job has had, within ``max_workers``), or to the previous round's size,
    or to ``min_workers``; the others stay spares. The plan carries the new target on.
    """
    if not requests:
        raise ValueError("A round needs at least one join request.")
    old_rank = {member: i for i, member in enumerate(previous)}
    ordered = sorted(requests, key=lambda r: (-r.version, old_rank.get(r.member_id, len(previous)),
                                              r.revision, r.member_id))
    # Positions and ids, not the requests themselves: comparing requests is slow, and these
    # lists hold every member of the job.
    waiting = [i for i, r in enumerate(ordered) if r.standby and r.member_id not in old_rank]
    taken = set(range(len(ordered))).difference(waiting)
    places = max(target, len(previous), min_workers) - len(taken)
    taken.update(waiting[:max(0, places)])
    candidates = [ordered[i] for i in sorted(taken)]
    cut = len(candidates) if max_workers is None else max_workers
    chosen = candidates[:cut]
    if config is not None and config.sharded and len({r.addr for r in chosen}) == 1:
        chosen = in_proportion(chosen, [r.member_id for r in chosen], previous,
                               config.shard_degree)
    chosen_ids = {r.member_id for r in chosen}
    spares = [r for r in ordered if r.member_id not in chosen_ids]
    most = max(target, len(chosen))
    return Plan(round=round_, ranks=[r.member_id for r in chosen],
                spares=[r.member_id for r in spares], master_addr=chosen[0].addr,
                master_port=chosen[0].port, versions={r.member_id: r.version for r in requests},
                target=most if max_workers is None else min(most, max_workers))
