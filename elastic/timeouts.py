"""The one table of timeouts and intervals: defaults, environment overrides, and their order.

Every duration the package waits for lives here, as a field of ``Timeouts``; modules receive
the value they need as an argument. ``Timeouts.from_env`` reads the ``ELASTIC_*`` variables
(``elastic run`` sets them from its flags for its workers). ``validate`` checks each value and
the hierarchy between them (which one must be shorter than which).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from datetime import timedelta

__all__ = ["Timeouts"]

_S = timedelta(seconds=1)


@dataclass(frozen=True)
class Timeouts:
    """Every timeout and interval of a worker and its launcher.

    Attributes:
        lease_ttl: a member's etcd lease; a frozen or cut-off worker is dropped after it
            (``ELASTIC_LEASE_TTL``, ``--lease-ttl``; default 3 s, at least 1 s).
        keepalive: how often the lease is renewed; must be well under ``lease_ttl``
            (``ELASTIC_KEEPALIVE``; default 0.75 s).
        settle: how long a round waits for more join requests once it could close, so that a
            node's workers leaving together make one round (``ELASTIC_SETTLE``, ``--settle``;
            default 0.5 s).
        rendezvous: how long a round may wait for ``min_workers`` (``ELASTIC_RENDEZVOUS_TIMEOUT``,
            ``--rendezvous-timeout``; default 300 s).
        admit: how long a spare waits to be admitted to a round (``ELASTIC_ADMIT_TIMEOUT``;
            default 1800 s).
        form: how long forming the process group and agreement channel may take; a member dying
            while the others connect costs this much (``ELASTIC_FORM_TIMEOUT``,
            ``--form-timeout``; default 20 s).
        store: each wait on the round's etcd-backed store (``ELASTIC_STORE_TIMEOUT``; 60 s).
        collective: the formed group's collective timeout, a backstop behind the detectors
            (``ELASTIC_COLLECTIVE_TIMEOUT``, ``--collective-timeout``; default 1800 s).
        sync: each broadcast of the newest state after forming (``ELASTIC_SYNC_TIMEOUT``; 300 s).
        finish: how long a member that returned waits for the others to return
            (``ELASTIC_FINISH_TIMEOUT``; default 300 s).
        etcd_rpc: one etcd request (``ELASTIC_ETCD_RPC_TIMEOUT``; default 3 s).
        etcd_retry: how long an etcd request is retried before ``EtcdUnavailableError``
            (``ELASTIC_ETCD_RETRY``; default 10 s).
        connect: how long ``elastic run`` and ``elastic status`` retry to reach etcd before they
            give up with one line (``ELASTIC_CONNECT_TIMEOUT``; default 5 s).
        node_settle: the settle window of plain mode, whose rounds are of whole nodes
            (``ELASTIC_NODE_SETTLE``; default 1 s).
        grace: how long workers get to leave after Ctrl-C/SIGTERM before they are killed
            (``ELASTIC_GRACE``, ``--grace``; default 30 s).
        restart_grace: how long a plain-mode worker of a broken generation gets before it is
            killed (it has nothing to save; default 3 s).
        wake: the longest a waiting loop sleeps between looks at a condition no event reaches
            (a settle deadline, a child process's exit; default 1 s).
        progress: how often rank 0 records a progress event (default 0.5 s).
    """

    lease_ttl: timedelta = 3 * _S
    keepalive: timedelta = 0.75 * _S
    settle: timedelta = 0.5 * _S
    rendezvous: timedelta = 300 * _S
    admit: timedelta = 1800 * _S
    form: timedelta = 20 * _S
    store: timedelta = 60 * _S
    collective: timedelta = 1800 * _S
    sync: timedelta = 300 * _S
    finish: timedelta = 300 * _S
    etcd_rpc: timedelta = 3 * _S
    etcd_retry: timedelta = 10 * _S
    connect: timedelta = 5 * _S
    node_settle: timedelta = 1 * _S
    grace: timedelta = 30 * _S
    restart_grace: timedelta = 3 * _S
    wake: timedelta = 1 * _S
    progress: timedelta = 0.5 * _S

    def __post_init__(self) -> None:
        self.validate()

    @staticmethod
    def env_name(field: str) -> str:
        """The environment variable that overrides ``field``."""
        special = {"rendezvous": "RENDEZVOUS_TIMEOUT", "admit": "ADMIT_TIMEOUT",
                   "form": "FORM_TIMEOUT", "store": "STORE_TIMEOUT",
                   "collective": "COLLECTIVE_TIMEOUT", "sync": "SYNC_TIMEOUT",
                   "finish": "FINISH_TIMEOUT", "etcd_rpc": "ETCD_RPC_TIMEOUT",
                   "connect": "CONNECT_TIMEOUT"}
        return "ELASTIC_" + special.get(field, field.upper())

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **given: timedelta) -> "Timeouts":
        """The defaults, overridden by ``ELASTIC_*`` variables, overridden by ``given``.

        Raises:
            ValueError: a variable is not a number of seconds, or a value breaks the hierarchy.
        """
        env = os.environ if environ is None else environ
        values: dict[str, timedelta] = {}
        for field in fields(cls):
            name = cls.env_name(field.name)
            raw = env.get(name, "").strip()
            if not raw:
                continue
            try:
                values[field.name] = timedelta(seconds=float(raw))
            except (ValueError, OverflowError):
                raise ValueError(f"{name}={raw!r} must be a number of seconds.") from None
        values.update(given)
        if "lease_ttl" in values and "keepalive" not in values:
            values["keepalive"] = values["lease_ttl"] / 4  # four renewals per lease
        return replace(cls(), **values)

    def as_env(self) -> dict[str, str]:
        """The ``ELASTIC_*`` variables that carry this table to a worker process."""
        return {self.env_name(f.name): repr(getattr(self, f.name).total_seconds())
                for f in fields(self)}

    def validate(self) -> None:
        """Raises ValueError naming the values and the fix when the table is inconsistent."""
        for field in fields(self):
            if getattr(self, field.name) <= timedelta(0):
                raise ValueError(f"{self.env_name(field.name)} ({getattr(self, field.name)}) "
                                 f"must be positive.")
        if self.lease_ttl < _S:
            raise ValueError(f"the lease TTL ({self.lease_ttl.total_seconds()} s) must be at "
                             f"least 1 second (--lease-ttl / ELASTIC_LEASE_TTL).")
        self._check_shorter("keepalive", "lease_ttl", factor=2)
        self._check_shorter("etcd_rpc", "etcd_retry", or_equal=True)
        self._check_shorter("settle", "rendezvous")
        self._check_shorter("form", "collective")
        self._check_shorter("sync", "collective", or_equal=True)

    def _check_shorter(self, short: str, long: str, factor: int = 1,
                       or_equal: bool = False) -> None:
        a, b = getattr(self, short), getattr(self, long)
        ok = a * factor <= b if or_equal else a * factor < b
        if not ok:
            times = f"{factor} x " if factor > 1 else ""
            raise ValueError(f"{times}{self.env_name(short)} ({a.total_seconds()} s) must be "
                             f"shorter than {self.env_name(long)} ({b.total_seconds()} s): "
                             f"raise {self.env_name(long)} or lower {self.env_name(short)}.")
