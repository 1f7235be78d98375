"""What one launcher is asked to do: ``LaunchSpec``, validated when it is made.

Built by ``elastic.launch.cli`` from the command line and the environment; read by the launcher
(``elastic.launch.launcher``) and by plain mode (``elastic.launch.plain``). It also derives what
each worker is started with (``worker_env``) and the job's configuration (``job_config``).
Reads no environment variables itself.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastic.cluster.links.interfaces import socket_interface_env
from elastic.foundation.settings import EtcdSecurity
from elastic.foundation.timeouts import Timeouts
from elastic.launch.job_config import JobConfig
from elastic.launch.output import OutputOptions


@dataclass(frozen=True)
class LaunchSpec:
    """Everything one launcher needs.

    Attributes:
        command: the worker command line.
        target: the script file name or "-m module" (part of the job's configuration).
        etcd: comma-separated etcd client URLs.
        job_id: the job's id.
        nproc: workers on this node.
        spares: warm spare workers on this node (``--spares``): started beside the ``nproc``
            workers, they take a round only in place of a member that is gone.
        node_lease: the workers register under this launcher's lease instead of each under
            its own (``--node-lease``); the launcher removes a worker that dies or whose
            heartbeats stop for a lease TTL (``elastic.cluster.rounds.membership.NodeLease``).
        min_workers: fewest workers to train with.
        max_workers: most workers to train with.
        max_restarts: restarts of crashed workers (plain: of generations) before giving up.
        checkpoint: durable checkpoint URL.
        backend: "auto", "nccl" or "gloo".
        advertise_addr: the address peers reach this node's workers on.
        log_dir: where workers write their events.
        timeouts: the job's timeout table (lease TTL, grace, ...), passed on to the workers.
        plain: torchrun-compatible mode.
        env: the environment workers start from (the CLI's, plus the ELASTIC_* variables).
        security: etcd's TLS files and user, passed on to the workers as ELASTIC_ETCD_*.
        output: how the workers' output is shown (prefixes, --tee files, a filter).
        metrics_port: the port this launcher serves Prometheus metrics on, at
            ``advertise_addr`` (None: no metrics).
        warm_start: fork the workers from a template process that imported their modules
            once (``elastic.launch.warm_start``); False: each starts as a new interpreter.
        preload: modules the template imports besides torch and the script's own imports.
    """

    command: tuple[str, ...]
    target: str
    etcd: str
    job_id: str
    nproc: int = 1
    spares: int = 0
    node_lease: bool = False
    min_workers: int = 1
    max_workers: int | None = None
    max_restarts: int = 3
    checkpoint: str | None = None
    backend: str = "auto"
    advertise_addr: str = "127.0.0.1"
    log_dir: str | None = None
    timeouts: Timeouts = Timeouts()
    plain: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    security: EtcdSecurity = EtcdSecurity()
    output: OutputOptions = OutputOptions()
    metrics_port: int | None = None
    warm_start: bool = True
    preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"--metrics-port ({self.metrics_port}) must be a TCP port, "
                             "1-65535.")
        if self.nproc < 1:
            raise ValueError(f"--nproc-per-node ({self.nproc}) must be at least 1.")
        if self.min_workers < 1:
            raise ValueError(f"--min-workers ({self.min_workers}) must be at least 1.")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"--max-workers ({self.max_workers}) must be >= --min-workers "
                             f"({self.min_workers}).")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts ({self.max_restarts}) must be >= 0.")
        if self.spares < 0:
            raise ValueError(f"--spares ({self.spares}) must be >= 0.")
        if self.spares and self.plain:
            raise ValueError("--spares works with elastic workers only: --plain restarts every "
                             "worker at each failure, so a spare would gain nothing.")
        if self.preload and (self.plain or not self.warm_start):
            raise ValueError("--preload needs the warm start: it names what the template "
                             "imports, and --plain or --no-warm-start start no template.")
        if self.node_lease and self.plain:
            raise ValueError("--node-lease works with elastic workers only: --plain workers "
                             "hold no etcd lease.")

    def job_config(self) -> JobConfig:
        return JobConfig(mode="plain" if self.plain else "elastic", target=self.target,
                         min_workers=self.min_workers, max_workers=self.max_workers,
                         checkpoint=self.checkpoint, backend=self.backend,
                         nproc=self.nproc if self.plain else None)

    def worker_env(self, local_rank: int, standby: bool = False) -> dict[str, str]:
        """The ELASTIC_* variables (and LOCAL_RANK) of one worker (``standby``: a warm spare)."""
        env = {
            "ELASTIC_ETCD": self.etcd, "ELASTIC_JOB_ID": self.job_id,
            "ELASTIC_MIN_WORKERS": str(self.min_workers),
            "ELASTIC_MAX_WORKERS": "" if self.max_workers is None else str(self.max_workers),
            "ELASTIC_CHECKPOINT": self.checkpoint or "", "ELASTIC_BACKEND": self.backend,
            "ELASTIC_ADVERTISE_ADDR": self.advertise_addr, "ELASTIC_LOG_DIR": self.log_dir or "",
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(self.nproc),
            "ELASTIC_CONSOLE": "quiet" if self.output.quiet else "launcher",
            **self.timeouts.as_env(), **self.security.as_env(),
            **socket_interface_env(self.advertise_addr, self.env),
        }
        if standby:
            env["ELASTIC_STANDBY"] = "1"
        if self.caps_threads:
            env["OMP_NUM_THREADS"] = "1"
        if "PYTHONUNBUFFERED" not in self.env:  # its lines reach the console as it prints them
            env["PYTHONUNBUFFERED"] = "1"
        return env

    @property
    def caps_threads(self) -> bool:
        """Whether workers get ``OMP_NUM_THREADS=1``: several workers share this node and the
        user did not choose a thread count (each would otherwise start one intra-op thread per
        core and they would fight over the cores; torchrun does the same)."""
        return self.nproc + self.spares > 1 and "OMP_NUM_THREADS" not in self.env


def join_command(spec: LaunchSpec) -> str:
    """The command that adds a worker of ``spec``'s job from another terminal."""
    parts = ["elastic", "run", "--etcd", spec.etcd, "--job-id", spec.job_id,
             "-n", str(spec.nproc if spec.plain else 1), *spec.security.as_flags()]
    if spec.plain:
        parts.append("--plain")
    if spec.min_workers != 1:
        parts += ["--min-workers", str(spec.min_workers)]
    if spec.max_workers is not None:
        parts += ["--max-workers", str(spec.max_workers)]
    if spec.checkpoint:
        parts += ["--checkpoint", spec.checkpoint]
    if spec.backend != "auto":
        parts += ["--backend", spec.backend]
    if spec.log_dir:
        parts += ["--log-dir", spec.log_dir]
    defaults = Timeouts()
    for field_name in Timeouts.FLAGS:  # the same budget on every node
        if getattr(spec.timeouts, field_name) != getattr(defaults, field_name):
            parts += [str(Timeouts.flag_name(field_name)),
                      f"{getattr(spec.timeouts, field_name).total_seconds():g}"]
    joined = shlex.join(parts + list(spec.command[1:]))
    if spec.security.password:  # never the password itself
        joined = f"ELASTIC_ETCD_PASSWORD=... {joined}"
    return joined
