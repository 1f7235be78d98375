"""Worker settings: explicit arguments first, then the ``ELASTIC_*`` environment variables.

``elastic run`` sets the variables for its workers; a worker started by hand with
``ELASTIC_ETCD`` and ``ELASTIC_JOB_ID`` joins the job the same way. This is the one place (with
the CLI) that reads ``os.environ``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from elastic.foundation.timeouts import Timeouts

# ELASTIC_CONSOLE: rank 0's story lines printed as they are, marked for the launcher (which
# shows them without a worker prefix), or not at all (--quiet); see elastic.console_story.
CONSOLE_MODES = ("plain", "launcher", "quiet")


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer.") from None


def is_debug() -> bool:
    """Whether ``ELASTIC_DEBUG`` asks for every error's whole chain of causes and traceback."""
    return os.environ.get("ELASTIC_DEBUG", "") not in ("", "0")


@dataclass(frozen=True)
class EtcdSecurity:
    """How to reach a TLS and authentication enabled etcd (etcdctl's names).

    Attributes:
        cacert: the CA bundle that verifies the server (None: the system's store).
        cert: this client's certificate (mutual TLS), with ``key``.
        key: the private key of ``cert``.
        user: the etcd user to authenticate as, with ``password``.
        password: its password; never printed, never on a command line.
    """

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    # Flag (and the variable that gives it) of each field: the names of the contract.
    FLAGS = {"cacert": "--etcd-cacert", "cert": "--etcd-cert", "key": "--etcd-key",
             "user": "--etcd-user", "password": "--etcd-password-file"}
    ENV = {"cacert": "ELASTIC_ETCD_CACERT", "cert": "ELASTIC_ETCD_CERT",
           "key": "ELASTIC_ETCD_KEY", "user": "ELASTIC_ETCD_USER",
           "password": "ELASTIC_ETCD_PASSWORD"}

    @staticmethod
    def resolve(*, cacert: str | None = None, cert: str | None = None, key: str | None = None,
                user: str | None = None, password_file: str | None = None) -> "EtcdSecurity":
        """Flags first, then the ``ELASTIC_ETCD_*`` variables; files become absolute paths.

        Raises:
            ValueError: a file is missing or unreadable, or a half of a pair is missing.
        """
        env = os.environ
        password = env.get("ELASTIC_ETCD_PASSWORD") or None
        if password_file:
            password = _read_password(password_file)
        security = EtcdSecurity(
            cacert=_absolute(cacert or env.get("ELASTIC_ETCD_CACERT")),
            cert=_absolute(cert or env.get("ELASTIC_ETCD_CERT")),
            key=_absolute(key or env.get("ELASTIC_ETCD_KEY")),
            user=user or env.get("ELASTIC_ETCD_USER") or None, password=password)
        security.validate()
        return security

    @property
    def uses_tls_files(self) -> bool:
        return bool(self.cacert or self.cert or self.key)

    def validate(self) -> None:
        """Raises:
            ValueError: a file is missing, or a certificate without its key (and vice versa),
                or a user without a password (and vice versa).
        """
        for name in ("cacert", "cert", "key"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"{self.FLAGS[name]} / {self.ENV[name]} ({path}) is not a "
                                 "readable file; give the path of the PEM file.")
        if bool(self.cert) != bool(self.key):
            raise ValueError("--etcd-cert and --etcd-key (ELASTIC_ETCD_CERT, ELASTIC_ETCD_KEY) "
                             "go together: give both, or neither.")
        if self.user and not self.password:
            raise ValueError(f"etcd user {self.user!r} needs a password: pass "
                             "--etcd-password-file FILE or set ELASTIC_ETCD_PASSWORD.")
        if self.password and not self.user:
            raise ValueError("An etcd password was given without a user: pass --etcd-user or "
                             "set ELASTIC_ETCD_USER.")

    def as_env(self) -> dict[str, str]:
        """The ``ELASTIC_ETCD_*`` variables that give a worker these settings (empty: unset)."""
        return {self.ENV[name]: getattr(self, name) or "" for name in self.ENV}

    def as_flags(self) -> list[str]:
        """The flags for another launcher's command line (never the password)."""
        return [part for name in ("cacert", "cert", "key", "user") if getattr(self, name)
                for part in (self.FLAGS[name], getattr(self, name))]


def _absolute(path: str | None) -> str | None:
    return str(Path(path).expanduser().resolve()) if path else None


def _read_password(path: str) -> str:
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ValueError(f"--etcd-password-file {path}: cannot read it ({exc.strerror or exc}); "
                         "give a file that holds the password.") from None
    password = text.rstrip("\r\n")
    if not password:
        raise ValueError(f"--etcd-password-file {path} is empty; it must hold the password.")
    return password


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker needs to join a job."""

    etcd: str | None
    job_id: str | None
    min_workers: int
    max_workers: int | None
    checkpoint: str | None
    backend: str
    advertise_addr: str
    local_rank: int
    timeouts: Timeouts
    log_dir: str | None
    etcd_security: EtcdSecurity = EtcdSecurity()
    lease_file: str | None = None
    node_lease: int | None = None  # the launcher's lease, shared by its workers (--node-lease)
    resume_finished: bool = False
    standby: bool = False
    checkpoint_from_env: str | None = None  # ELASTIC_CHECKPOINT (--checkpoint under `elastic run`)
    debug: bool = False  # ELASTIC_DEBUG=1: errors keep their causes and tracebacks
    launcher: str | None = None  # ELASTIC_LAUNCHER: the launcher that started this worker
    launcher_workers: int = 0  # LOCAL_WORLD_SIZE under that launcher (0: started by hand)
    launcher_pid: int | None = None  # ELASTIC_LAUNCHER_PID: this worker's parent, the launcher
    console: str = "plain"  # ELASTIC_CONSOLE: how rank 0 tells the story (CONSOLE_MODES)
    started_from: str = "python"  # ELASTIC_STARTED_FROM: "template" when forked warm

    @staticmethod
    def resolve(*, etcd: str | None, job_id: str | None, min_workers: int | None,
                max_workers: int | None, checkpoint: str | None) -> "WorkerSettings":
        """Fills what the caller left None from the environment.

        Raises:
            ValueError: a value is malformed or the limits contradict each other.
        """
        env = os.environ
        settings = WorkerSettings(
            etcd=etcd or env.get("ELASTIC_ETCD") or None,
            job_id=job_id or env.get("ELASTIC_JOB_ID") or None,
            min_workers=min_workers if min_workers is not None
            else (_env_int("ELASTIC_MIN_WORKERS") or 1),
            max_workers=max_workers if max_workers is not None
            else _env_int("ELASTIC_MAX_WORKERS"),
            checkpoint=checkpoint or env.get("ELASTIC_CHECKPOINT") or None,
            backend=env.get("ELASTIC_BACKEND", "auto"),
            advertise_addr=env.get("ELASTIC_ADVERTISE_ADDR", "127.0.0.1"),
            local_rank=_env_int("LOCAL_RANK") or 0,
            timeouts=Timeouts.from_env(),
            log_dir=env.get("ELASTIC_LOG_DIR") or None,
            etcd_security=EtcdSecurity.resolve(),
            lease_file=env.get("ELASTIC_LEASE_FILE") or None,
            node_lease=_env_int("ELASTIC_NODE_LEASE"),
            resume_finished=env.get("ELASTIC_RESUME_FINISHED", "") not in ("", "0"),
            standby=env.get("ELASTIC_STANDBY", "") not in ("", "0"),
            checkpoint_from_env=env.get("ELASTIC_CHECKPOINT") or None,
            debug=is_debug(),
            launcher=env.get("ELASTIC_LAUNCHER") or None,
            launcher_workers=(_env_int("LOCAL_WORLD_SIZE") or 0) if env.get("ELASTIC_LAUNCHER")
            else 0,
            launcher_pid=_env_int("ELASTIC_LAUNCHER_PID"),
            console=env.get("ELASTIC_CONSOLE") or "plain",
            started_from=env.get("ELASTIC_STARTED_FROM") or "python",
        )
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.console not in CONSOLE_MODES:
            raise ValueError(f"ELASTIC_CONSOLE ({self.console!r}) must be one of "
                             f"{', '.join(CONSOLE_MODES)}.")
        if self.min_workers < 1:
            raise ValueError(f"min_workers ({self.min_workers}) must be >= 1.")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) must be >= min_workers "
                             f"({self.min_workers}).")
