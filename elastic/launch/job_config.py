"""A job's configuration in etcd: written by its first launcher, checked by every later one.

Owns the ``config`` key of a job. A launcher that finds the job running (a live launcher or
worker) with another configuration is refused with a message that names the differences; a job
id with nobody alive is started afresh (the keys of its previous run are removed in the same
transaction that writes the new config, so that an old "done" round does not end the new run at
once and two launchers starting it together cannot both wipe it). It must not start processes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from elastic.foundation.errors import ElasticError
from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys


class JobConfigError(ElasticError):
    """A launcher's configuration contradicts the running job's."""


@dataclass(frozen=True)
class JobConfig:
    """What every launcher of one job must agree on.

    Attributes:
        mode: "elastic" (ElasticState workers) or "plain" (torchrun-compatible).
        target: the script's file name, or "-m module".
        min_workers: fewest workers to train with.
        max_workers: most workers to train with (None: no limit).
        checkpoint: the durable checkpoint URL, if any.
        backend: "auto", "nccl" or "gloo".
        nproc: workers per launcher; fixed only in plain mode (None otherwise).
    """

    mode: str
    target: str
    min_workers: int
    max_workers: int | None
    checkpoint: str | None
    backend: str
    nproc: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(raw: bytes) -> "JobConfig":
        return JobConfig(**json.loads(raw))

    def differences(self, other: "JobConfig") -> list[str]:
        """Names each field that differs, as ``name: theirs != ours``."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{name}: {_shown(theirs[name])} (running) != {_shown(mine[name])} (yours)"
                for name in mine if mine[name] != theirs[name]]


def _shown(value: object) -> str:
    """A setting as a user would name it: none when unset (not Python's ``None``)."""
    return "none" if value is None else repr(value)


def is_running(client: EtcdClient, keys: JobKeys) -> bool:
    """Whether any launcher or worker of the job holds a live registration."""
    workers, _ = client.get_prefix(keys.members)
    launchers, _ = client.get_prefix(keys.launchers().members)
    return bool(workers or launchers)


def claim(client: EtcdClient, keys: JobKeys, config: JobConfig) -> bool:
    """Records ``config`` as the job's, or checks it against the running job's.

    Returns:
        True when this launcher started the job (nobody was running), False when it joined.

    Raises:
        JobConfigError: the job runs with another configuration.
        EtcdUnavailableError: etcd could not be reached.
    """
    existing = client.get(keys.config)
    if not is_running(client, keys):
        # One transaction, guarded by the config revision read above: of two launchers that
        # both found the job dead, one clears the old run's keys and writes; the other sees
        # that config below instead of wiping the first one's fresh keys.
        seen = existing.mod_revision if existing is not None else 0
        if client.replace(keys.config, config.to_json(), seen,
                          clearing=(keys.prefix, keys.launchers().prefix)).revision:
            return True
        existing = client.get(keys.config)
    if existing is None:
        client.put(keys.config, config.to_json())
        return False
    running = JobConfig.from_json(existing.value)
    diffs = config.differences(running)
    if diffs:
        raise JobConfigError(
            f"Job {keys.job_id!r} is already running with another configuration "
            f"({'; '.join(diffs)}): use the same options, or pick another --job-id.")
    return False
