"""Worker settings: explicit arguments first, then the ``ELASTIC_*`` environment variables.

``elastic run`` sets the variables for its workers; a worker started by hand with
``ELASTIC_ETCD`` and ``ELASTIC_JOB_ID`` joins the job the same way. This is the one place (with
the CLI) that reads ``os.environ``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from elastic.timeouts import Timeouts


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer.") from None


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
    resume_finished: bool = False

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
            resume_finished=env.get("ELASTIC_RESUME_FINISHED", "") not in ("", "0"),
        )
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_workers ({self.min_workers}) must be >= 1.")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) must be >= min_workers "
                             f"({self.min_workers}).")
