"""The one table of timeouts and intervals: defaults, overrides, and the order between them.

Every duration the package waits for, retries for or paces by lives here, as a field of
``Timeouts``; the modules that wait receive the value they need as an argument and hold no
literal of their own (a test reads their source to keep it so). ``Timeouts.from_env`` reads the
``ELASTIC_*`` variables; ``elastic run`` sets them for its workers from its flags
(``Timeouts.FLAGS``). Building a table validates it: every value positive, and the hierarchy
(which value must be shorter than which), each violation one sentence naming both values and
the fix. This module must import nothing from ``elastic`` but ``elastic.foundation.errors``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import Any

__all__ = ["Timeouts"]

_S = timedelta(seconds=1)


def _entry(seconds: float, env: str | None = None) -> Any:
    """A field of the table: its default, and its variable when not ``ELASTIC_<NAME>``."""
    return field(default=seconds * _S, metadata={"env": env} if env else {})


@dataclass(frozen=True)
class Timeouts:
    """Every timeout and interval of a worker and its launcher; see each field.

    The order it enforces (``validate``): 2 x keepalive < lease_ttl; peer_probe <= peer;
    2 x heartbeat < frozen;
    settle and node_settle < rendezvous; settle and node_settle < rejoin; release < rejoin;
    form < collective; sync <= collective; etcd_rpc <= etcd_retry <= etcd_outage; backoff and
    reconnect <= backoff_max. A frozen worker is left out within frozen (+ heartbeat); one cut from
    etcd is dropped within lease_ttl (+ form while its survivors connect); one cut from its peers within peer + peer_probe; a killed
    one at once.
    """

    # -- membership and rounds --------------------------------------------------------------
    lease_ttl: timedelta = _entry(3)
    """Default 3 s (``ELASTIC_LEASE_TTL``, ``--lease-ttl``): a member's etcd lease. A frozen or
    cut-off worker is dropped this long after its last keepalive. At least 1 s (etcd leases are
    whole seconds)."""
    keepalive: timedelta = _entry(0.75)
    """Default 0.75 s, a quarter of the lease TTL when only the TTL is set
    (``ELASTIC_KEEPALIVE``): how often the lease is renewed. Under half the lease TTL."""
    settle: timedelta = _entry(0.5)
    """Default 0.5 s (``ELASTIC_SETTLE``, ``--settle``): how long a round that could close waits
    for unknown joiners (live members outside the last round that have not asked yet), so that a
    node's workers starting together make one round. Never used to leave out a member of the
    last round (see ``rejoin``)."""
    local_start: timedelta = _entry(30)
    """Default 30 s (``ELASTIC_LOCAL_START``): how long a job's first round, while nothing
    changes, waits for the workers a launcher started that have not asked to join yet (under
    load a node's workers reach ``state.run()`` seconds apart); capped at half of ``rendezvous``,
    so a short rendezvous timeout needs no change here."""
    node_settle: timedelta = _entry(1)
    """Default 1 s (``ELASTIC_NODE_SETTLE``): the settle window of ``--plain`` generations,
    whose rounds are of whole nodes."""
    rejoin: timedelta = _entry(120, "ELASTIC_REJOIN_TIMEOUT")
    """Default 120 s (``ELASTIC_REJOIN_TIMEOUT``, ``--rejoin-timeout``): how long a re-formation
    waits for a live member of the previous round (one inside a long step, say) that has not
    asked to join; a member that died is not waited for (its connection ended, or its lease is
    gone), so this bounds only a live member that never comes back."""
    release: timedelta = _entry(30, "ELASTIC_RELEASE_GRACE")
    """Default 30 s (``ELASTIC_RELEASE_GRACE``, ``--release-grace``): how long the training
    thread may stay inside its step after a peer failure released the round. Past it the
    worker leaves the job and restarts in place (same process id, command line and
    environment) as a new member: its collective was not woken (a gloo race, see
    docs/troubleshooting.md, Known limits), or its step runs longer than this without any
    collective. Under ``rejoin``."""
    rendezvous: timedelta = _entry(300, "ELASTIC_RENDEZVOUS_TIMEOUT")
    """Default 300 s (``ELASTIC_RENDEZVOUS_TIMEOUT``, ``--rendezvous-timeout``): how long a
    round may wait for ``min_workers`` before ``RendezvousTimeoutError``."""
    peer: timedelta = _entry(2.5, "ELASTIC_PEER_TIMEOUT")
    """Default 2.5 s (``ELASTIC_PEER_TIMEOUT``, ``--peer-timeout``): how long an agreement
    connection between two members may go without an acknowledgement from the other side (the
    kernel's ``TCP_USER_TIMEOUT``, with a keepalive probe every ``peer_probe``: one lost probe
    is survived) before it is declared down. Only a silent network does that: a frozen or busy process's kernel still
    acknowledges, and a dead process's kernel ends the connection at once."""
    peer_probe: timedelta = _entry(1)
    """Default 1 s (``ELASTIC_PEER_PROBE``): how often an idle agreement connection is probed
    (``TCP_KEEPIDLE`` and ``TCP_KEEPINTVL``, which count whole seconds: rounded up)."""
    frozen: timedelta = _entry(0.5, "ELASTIC_FROZEN_TIMEOUT")
    """Default 0.5 s (``ELASTIC_FROZEN_TIMEOUT``, ``--frozen-timeout``): how long a member's
    heartbeats on its agreement connections may stop, while its machine still acknowledges
    them, before it is reported frozen (stopped: SIGSTOP, a debugger) and left out without
    waiting for its lease. Its heartbeat process beats whatever the worker does but stop: a
    long step, a native op, a full garbage collection or a starved CPU is never frozen."""
    heartbeat: timedelta = _entry(0.1)
    """Default 0.1 s (``ELASTIC_HEARTBEAT``): how often each end of an agreement connection
    sends a heartbeat and looks at what it heard, and how often a member waiting for the next
    round looks again at its connections of the last one. Under half of ``frozen``."""
    admit: timedelta = _entry(1800, "ELASTIC_ADMIT_TIMEOUT")
    """Default 1800 s (``ELASTIC_ADMIT_TIMEOUT``): how long a new worker waits to be admitted
    by the running members (they admit at a commit) before ``RendezvousTimeoutError``."""

    # -- forming and training ----------------------------------------------------------------
    form: timedelta = _entry(20, "ELASTIC_FORM_TIMEOUT")
    """Default 20 s (``ELASTIC_FORM_TIMEOUT``, ``--form-timeout``): forming a round's process
    group and agreement channel; a member dying while the others connect costs this much."""
    free_group: timedelta = _entry(1)
    """Default 1 s (``ELASTIC_FREE_GROUP``): how long a re-formation waits for the last round's
    gloo group to be freed. That takes milliseconds, unless a collective that the release did
    not wake still holds gloo's worker thread: then the group is freed when that collective
    ends (at ``collective`` at the latest), and the next round does not wait for it. An NCCL
    group is waited for up to ``form``."""
    store: timedelta = _entry(60, "ELASTIC_STORE_TIMEOUT")
    """Default 60 s (``ELASTIC_STORE_TIMEOUT``): connecting to the round's store (hosted by its
    rank 0, its address in etcd), and each wait for one of its keys."""
    collective: timedelta = _entry(1800, "ELASTIC_COLLECTIVE_TIMEOUT")
    """Default 1800 s (``ELASTIC_COLLECTIVE_TIMEOUT``, ``--collective-timeout``): any collective
    of the formed group, and an agreement exchange; a backstop behind the failure detectors."""
    sync: timedelta = _entry(300, "ELASTIC_SYNC_TIMEOUT")
    """Default 300 s (``ELASTIC_SYNC_TIMEOUT``): each broadcast of the newest state after a
    round formed."""
    finish: timedelta = _entry(300, "ELASTIC_FINISH_TIMEOUT")
    """Default 300 s (``ELASTIC_FINISH_TIMEOUT``): how long a member that returned from training
    waits for the others of its round to return or go."""
    finished_marker: timedelta = _entry(600)
    """Default 600 s (``ELASTIC_FINISHED_MARKER``): how long the keys that say a job finished (its
    news, its round counter and its last round's done marks) outlive the job, bound to a lease
    of this TTL: a worker that comes within it is told the job finished; after it the job
    id is free again."""
    progress: timedelta = _entry(0.5)
    """Default 0.5 s (``ELASTIC_PROGRESS``): how often rank 0 records a progress event."""
    storage_retry: timedelta = _entry(60)
    """Default 60 s (``ELASTIC_STORAGE_RETRY``): how long one checkpoint storage call retries
    transient errors (the checkpoint store's ``retry_for``) before its error is raised."""
    final_write: timedelta = _entry(300, "ELASTIC_FINAL_WRITE_TIMEOUT")
    """Default 300 s (``ELASTIC_FINAL_WRITE_TIMEOUT``): how long a worker that is done waits
    for its last checkpoint write; past it the write is abandoned and ``run()`` raises
    ``UnfinishedWriteError`` (the checkpoint before it stays valid)."""
    checkpoint_claim: timedelta = _entry(60)
    """Default 60 s (``ELASTIC_CHECKPOINT_CLAIM``): how long a job's claim on its checkpoint URL
    (``holder.json``, renewed by ``elastic run`` every third of this) outlives its last
    heartbeat; a second job on the URL is refused while it is fresh."""

    # -- etcd ----------------------------------------------------------------------------------
    etcd_rpc: timedelta = _entry(3, "ELASTIC_ETCD_RPC_TIMEOUT")
    """Default 3 s (``ELASTIC_ETCD_RPC_TIMEOUT``): one etcd request."""
    etcd_retry: timedelta = _entry(10)
    """Default 10 s (``ELASTIC_ETCD_RETRY``): how long a worker retries an etcd request before
    ``EtcdUnavailableError``."""
    etcd_outage: timedelta = _entry(600)
    """Default 600 s (``ELASTIC_ETCD_OUTAGE``, ``--etcd-outage``): how long workers that must
    form a new round wait for an unreachable etcd before they give up. Training with the world
    unchanged never needs etcd and goes on through an outage of any length."""
    connect: timedelta = _entry(5, "ELASTIC_CONNECT_TIMEOUT")
    """Default 5 s (``ELASTIC_CONNECT_TIMEOUT``): how long ``elastic run`` and ``elastic status``
    retry an etcd request before they give up with one line."""
    backoff: timedelta = _entry(0.05)
    """Default 0.05 s (``ELASTIC_BACKOFF``): the first pause before retrying an etcd request or
    re-opening a broken watch; it doubles (with jitter) up to ``backoff_max``."""
    backoff_max: timedelta = _entry(1)
    """Default 1 s (``ELASTIC_BACKOFF_MAX``): the longest pause between etcd retries, re-watches
    and reconnection attempts."""
    reconnect: timedelta = _entry(0.2)
    """Default 0.2 s (``ELASTIC_RECONNECT``): the first pause before reconnecting to etcd after
    a connection was lost (gRPC's reconnect backoff, growing up to ``backoff_max``)."""
    etcd_ping: timedelta = _entry(5)
    """Default 5 s (``ELASTIC_ETCD_PING``): how often an idle connection to etcd is pinged."""
    etcd_ping_timeout: timedelta = _entry(2)
    """Default 2 s (``ELASTIC_ETCD_PING_TIMEOUT``): a ping unanswered this long drops the
    connection (it is re-made at the next request)."""
    etcd_start: timedelta = _entry(20)
    """Default 20 s (``ELASTIC_ETCD_START``): how long an embedded etcd may take to answer its
    health check before another port is tried."""

    # -- processes ---------------------------------------------------------------------------
    replace_wait: timedelta = _entry(2)
    """Default 2 s (``ELASTIC_REPLACE_WAIT``): how long ``elastic run`` holds back the cold start
    of a crashed worker's replacement while the survivors re-form without it (it starts
    ``settle`` after their next round formed; a cold start's seconds of CPU would otherwise
    compete with them)."""
    template_ready: timedelta = _entry(120)
    """Default 120 s (``ELASTIC_TEMPLATE_READY``): how long ``elastic run``'s warm-start
    template may take to import torch and the script's imports before workers start cold."""
    fork: timedelta = _entry(5)
    """Default 5 s (``ELASTIC_FORK``): how long the warm-start template may take to answer one
    request for a worker (a fork: milliseconds) before it is given up and workers start cold;
    also how long a forked worker waits to be adopted by the launcher."""
    warm_connect: timedelta = _entry(0.3)
    """Default 0.3 s (``ELASTIC_WARM_CONNECT``): the same hold for a replacement forked from the
    warm-start template (no imports, but the script's own setup still competes with the
    survivors' first step)."""
    grace: timedelta = _entry(30)
    """Default 30 s (``ELASTIC_GRACE``, ``--grace``): how long workers get to leave after
    Ctrl-C/SIGTERM before they are killed."""
    restart_grace: timedelta = _entry(3)
    """Default 3 s (``ELASTIC_RESTART_GRACE``): how long a ``--plain`` worker of a broken
    generation gets after SIGTERM before it is killed (it has nothing to save)."""
    shutdown: timedelta = _entry(5)
    """Default 5 s (``ELASTIC_SHUTDOWN``): how long stopping something waits for it to end:
    the etcd client's connection and thread, a watch, the signal relay thread, an embedded etcd
    after SIGTERM (then SIGKILL), a restarting worker's subprocesses after SIGKILL and its
    resource tracker after its pipe closed (each); also how much longer than ``etcd_rpc`` a
    request waits for the etcd client's thread to hand its reply back."""
    drain: timedelta = _entry(0.2)
    """Default 0.2 s (``ELASTIC_DRAIN``): how long the launcher, once a worker exited, waits
    for the last of its output to be copied before it acts on the exit (revokes its lease,
    starts its replacement). A child of the worker holding its output pipes keeps them open;
    their lines go on being shown."""
    reap: timedelta = _entry(10)
    """Default 10 s (``ELASTIC_REAP``): how long the launcher waits for a worker it killed
    (SIGKILL) to be reaped before it reports the worker as a survivor."""

    # -- pacing of waits no event reaches ----------------------------------------------------
    wake: timedelta = _entry(1)
    """Default 1 s (``ELASTIC_WAKE``): the longest a wait sleeps before it looks again at a
    condition no event reaches (a rendezvous deadline, a child's exit, the end of a job); the
    longest one attempt to connect to a round's store waits for it to accept; also
    the timeout of one health request to an embedded etcd."""
    poll: timedelta = _entry(0.05)
    """Default 0.05 s (``ELASTIC_POLL``): the pause between two health requests to a starting
    embedded etcd (another process, with nothing to wait on), and between two probes of a
    round's store that refused (the round's release ends that pause)."""

    #: The fields ``elastic run`` takes as flags (in seconds), with their help.
    FLAGS = MappingProxyType({
        "lease_ttl": "seconds without a keepalive before a worker is dropped",
        "settle": "seconds a round waits for more joiners once it could close",
        "rejoin": "seconds a re-formation waits for a live member of the last round",
        "release": "seconds a step may stay blocked after a peer failure released its round "
                   "before the worker restarts in place",
        "rendezvous": "seconds a round may wait for --min-workers",
        "form": "seconds forming a round's process group may take",
        "peer": "seconds a silent link between two workers is given before it counts as cut",
        "frozen": "seconds a worker may send no heartbeat before it counts as frozen",
        "collective": "backstop on any collective, behind the failure detectors",
        "grace": "seconds workers get to leave after Ctrl-C/SIGTERM",
        "etcd_outage": "seconds workers wait for an unreachable etcd to form a new round",
    })

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def env_name(cls, name: str) -> str:
        """The environment variable that overrides field ``name``."""
        entry = cls.__dataclass_fields__[name]
        return entry.metadata.get("env") or f"ELASTIC_{name.upper()}"

    @classmethod
    def flag_name(cls, name: str) -> str | None:
        """The ``elastic run`` flag that sets field ``name``, or None."""
        if name not in cls.FLAGS:
            return None
        return "--" + cls.env_name(name).removeprefix("ELASTIC_").lower().replace("_", "-")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 **given: timedelta) -> "Timeouts":
        """The defaults, overridden by ``ELASTIC_*`` variables, overridden by ``given``.

        A lease TTL set without a keepalive interval brings four renewals per lease.

        Raises:
            ValueError: a variable is not a number of seconds, or a value is not positive or
                breaks the hierarchy.
        """
        env = os.environ if environ is None else environ
        values: dict[str, timedelta] = {}
        for entry in fields(cls):
            name = cls.env_name(entry.name)
            raw = env.get(name, "").strip()
            if not raw:
                continue
            try:
                values[entry.name] = timedelta(seconds=float(raw))
            except (ValueError, OverflowError):
                raise ValueError(f"{name}={raw!r} must be a number of seconds, e.g. "
                                 f"{name}={entry.default.total_seconds():g}.") from None
        values.update(given)
        if "lease_ttl" in values and "keepalive" not in values:
            values["keepalive"] = values["lease_ttl"] / 4
        return replace(cls(), **values)

    def as_env(self) -> dict[str, str]:
        """The ``ELASTIC_*`` variables that carry this whole table to a worker process."""
        return {self.env_name(f.name): repr(getattr(self, f.name).total_seconds())
                for f in fields(self)}

    def validate(self) -> None:
        """Checks every value and the hierarchy.

        Raises:
            ValueError: one sentence naming the values and the fix.
        """
        for entry in fields(self):
            value = getattr(self, entry.name)
            if value <= timedelta(0):
                raise ValueError(f"{self._name(entry.name)} ({_seconds(value)}) must be "
                                 f"positive: set it to a number of seconds above 0.")
        if self.lease_ttl < _S:
            raise ValueError(f"{self._name('lease_ttl')} ({_seconds(self.lease_ttl)}) must be "
                             f"at least 1 s: etcd leases are whole seconds.")
        self._check("keepalive", "lease_ttl", factor=2)
        self._check("peer_probe", "peer", or_equal=True)
        self._check("heartbeat", "frozen", factor=2)
        self._check("settle", "rendezvous")
        self._check("node_settle", "rendezvous")
        self._check("settle", "rejoin")
        self._check("node_settle", "rejoin")
        self._check("release", "rejoin")
        self._check("form", "collective")
        self._check("sync", "collective", or_equal=True)
        self._check("etcd_rpc", "etcd_retry", or_equal=True)
        self._check("etcd_retry", "etcd_outage", or_equal=True)
        self._check("backoff", "backoff_max", or_equal=True)
        self._check("reconnect", "backoff_max", or_equal=True)

    @classmethod
    def _name(cls, name: str) -> str:
        flag = cls.flag_name(name)
        return cls.env_name(name) + (f" / {flag}" if flag else "")

    def _check(self, short: str, long: str, factor: int = 1, or_equal: bool = False) -> None:
        a, b = getattr(self, short), getattr(self, long)
        if a * factor < b or (or_equal and a * factor == b):
            return
        times = f"{factor} x " if factor > 1 else ""
        shorter = "at most" if or_equal else "shorter than"
        raise ValueError(f"{times}{self._name(short)} ({_seconds(a)}) must be {shorter} "
                         f"{self._name(long)} ({_seconds(b)}): lower {self.env_name(short)} or "
                         f"raise {self.env_name(long)}.")


def _seconds(value: timedelta) -> str:
    return f"{value.total_seconds():g} s"
