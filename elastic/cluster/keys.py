"""The only place where etcd keys are built.

Layout under ``/elastic/{job_id}/``:

- ``members/{member}``: lease-bound registration (address, host, pid, lease).
- ``round``: the number of the newest round that has a plan.
- ``rounds/{n}/join/{member}``: lease-bound request to be in round ``n``.
- ``rounds/{n}/plan``: the agreed world of round ``n``, created once by compare-and-swap.
- ``rounds/{n}/done/{member}``: the member returned from the training function.
- ``rounds/{n}/store/``: the torch.distributed store of round ``n`` (fresh per round).
- ``commit``: the newest commit version and the newest durable checkpoint, for ``elastic status``.
- ``config``: the job's configuration, written by the first launcher.

The launchers of a job (``elastic run``) register under a sibling job, ``{job_id}.launchers``
(``JobKeys.launchers``), with the same layout: its ``members/`` are the live launchers and its
rounds are the generations of ``--plain`` (torchrun-compatible) jobs.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = "/elastic"


@dataclass(frozen=True)
class JobKeys:
    """Builds the etcd keys of one job."""

    job_id: str

    def __post_init__(self) -> None:
        if not self.job_id or "/" in self.job_id:
            raise ValueError(f"job id {self.job_id!r} must be non-empty and contain no '/'.")

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.job_id}/"

    @property
    def members(self) -> str:
        return f"{self.prefix}members/"

    def member(self, member_id: str) -> str:
        return f"{self.members}{member_id}"

    @property
    def round(self) -> str:
        return f"{self.prefix}round"

    @property
    def rounds(self) -> str:
        return f"{self.prefix}rounds/"

    def round_prefix(self, n: int) -> str:
        return f"{self.rounds}{n:08d}/"

    def joins(self, n: int) -> str:
        return f"{self.round_prefix(n)}join/"

    def join(self, n: int, member_id: str) -> str:
        return f"{self.joins(n)}{member_id}"

    def plan(self, n: int) -> str:
        return f"{self.round_prefix(n)}plan"

    def dones(self, n: int) -> str:
        return f"{self.round_prefix(n)}done/"

    def done(self, n: int, member_id: str) -> str:
        return f"{self.dones(n)}{member_id}"

    def store(self, n: int) -> str:
        return f"{self.round_prefix(n)}store/"

    @property
    def commit(self) -> str:
        return f"{self.prefix}commit"

    @property
    def config(self) -> str:
        return f"{self.prefix}config"

    def launchers(self) -> "JobKeys":
        """The keys of this job's launchers (their membership and ``--plain`` generations)."""
        return JobKeys(f"{self.job_id}.launchers")

    def round_of(self, key: str) -> int | None:
        """Returns the round number in a ``rounds/{n}/...`` key, or None for other keys."""
        if not key.startswith(self.rounds):
            return None
        head = key[len(self.rounds):].split("/", 1)[0]
        return int(head) if head.isascii() and head.isdigit() else None
