"""The only place where etcd keys are built.

Layout under ``/elastic/{job_id}/``:

- ``members/{member}``: lease-bound registration (address, host, pid, lease).
- ``round``: the number of the newest round that has a plan.
- ``rounds/{n}/join/{member}``: lease-bound request to be in round ``n``.
- ``rounds/{n}/plan``: the agreed world of round ``n``, created once by compare-and-swap.
- ``rounds/{n}/done/{member}``: the member returned from the training function.
- ``rounds/{n}/gone/{member}/{reporter}``: bound to the lease of ``reporter``, a member of round
  ``n - 1`` that saw ``member``'s connection of round ``n - 1`` end: ``ended`` (by the peer's
  kernel: its process is gone) or ``silent`` (the network acknowledged nothing for the peer
  timeout: it may be alive and cut off).
- ``rounds/{n}/store/address``: where round ``n``'s rank 0 hosts its TCPStore
  (``round_store.py``, what a worker forms its group on).
- ``rounds/{n}/store/channel``: round ``n``'s agreement channel: rank 0's address and the
  round's secret (``channel_book.py``), written before the store's address.
- ``commit``: the newest commit version and the newest durable checkpoint, for ``elastic status``.
- ``config``: the job's configuration, written by the first launcher.
- ``fence``: the job's fencing epoch for durable commits, created once by compare-and-swap.
- ``control/coordinator``: lease-bound, the member that reads everyone's records and closes
  rounds (``coordinator.py``); created by compare-and-swap, taken over when its lease ends.
- ``control/news``: what the coordinator tells every member about the newest round (``news.py``).
- ``assigned/{member}``: bound to the member's lease, its seat in the newest round it is named
  in (``seat.py``): written empty by the member's registration, with its member key, then by
  the coordinator after each round's plan, before its news. It goes with the member's lease,
  by ``drop_member``, and by the coordinator when a member key is deleted otherwise; its
  deletion fences the member (a member that a round left out also checks its member key: one
  deleted while no coordinator watched). Members watch only ``control/`` and their own
  seat, so a change costs each of them O(1) (the coordinator's watch, after ``control/``, does
  not hold the seats).

The launchers of a job (``elastic run``) register under a sibling job, ``{job_id}.launchers``
(``JobKeys.launchers``), with the same layout: its ``members/`` are the live launchers and its
rounds are the generations of ``--plain`` (torchrun-compatible) jobs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from elastic.cluster.etcd.key_range import KeyRange

ROOT = "/elastic"
MAX_JOB_ID = 64
LAUNCHERS_SUFFIX = ".launchers"
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_job_id(job_id: str) -> str:
    """Returns ``job_id`` if it is fit to become a key prefix (and an etcd role's name).

    Raises:
        ValueError: empty, longer than ``MAX_JOB_ID``, other characters than letters,
            digits, ``.``, ``_`` and ``-`` (starting with a letter or digit), or ending in
            ``LAUNCHERS_SUFFIX`` (the prefix of another job's launchers).
    """
    if len(job_id) > MAX_JOB_ID:
        raise ValueError(f"job id {job_id[:MAX_JOB_ID]!r}... is {len(job_id)} characters long; "
                         f"use at most {MAX_JOB_ID}.")
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"job id {job_id!r} must start with a letter or digit and hold only "
                         "letters, digits, '.', '_' and '-' (it becomes the etcd prefix "
                         f"{ROOT}/ID/).")
    if job_id.endswith(LAUNCHERS_SUFFIX):
        raise ValueError(f"job id {job_id!r} ends in {LAUNCHERS_SUFFIX!r}, which names the keys "
                         f"of job {job_id.removesuffix(LAUNCHERS_SUFFIX)!r}'s launchers; choose "
                         "another id.")
    return job_id


@dataclass(frozen=True)
class JobKeys:
    """Builds the etcd keys of one job."""

    job_id: str
    of_launchers: bool = field(default=False, repr=False)  # built by ``launchers()``

    def __post_init__(self) -> None:
        check_job_id(self.job_id.removesuffix(LAUNCHERS_SUFFIX) if self.of_launchers
                     else self.job_id)

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

    def gones(self, n: int) -> str:
        return f"{self.round_prefix(n)}gone/"

    def gone(self, n: int, member_id: str, reporter: str) -> str:
        """A report by ``reporter`` that ``member_id`` of round ``n - 1`` is gone."""
        return f"{self.gones(n)}{member_id}/{reporter}"

    def store(self, n: int) -> str:
        return f"{self.round_prefix(n)}store/"

    def store_address(self, n: int) -> str:
        return f"{self.store(n)}address"

    def channel(self, n: int) -> str:
        return f"{self.store(n)}channel"

    @property
    def commit(self) -> str:
        return f"{self.prefix}commit"

    @property
    def config(self) -> str:
        return f"{self.prefix}config"

    @property
    def fence(self) -> str:
        return f"{self.prefix}fence"

    @property
    def control(self) -> str:
        return f"{self.prefix}control/"

    @property
    def coordinated(self) -> KeyRange:
        """What the coordinator watches: the keys after ``control/`` (members, the round
        counter, the rounds). ``control/`` reaches it by its own member's watch; ``commit`` and
        ``config``, which sort before it, are none of its business."""
        return KeyRange.after_prefix(self.control, self.prefix)

    @property
    def coordinator(self) -> str:
        return f"{self.control}coordinator"

    @property
    def news(self) -> str:
        return f"{self.control}news"

    @property
    def seats(self) -> str:
        return f"{self.prefix}assigned/"

    def seat(self, member_id: str) -> str:
        return f"{self.seats}{member_id}"

    def launchers(self) -> "JobKeys":
        """The keys of this job's launchers (their membership and ``--plain`` generations)."""
        return JobKeys(f"{self.job_id}{LAUNCHERS_SUFFIX}", of_launchers=True)

    def round_of(self, key: str) -> int | None:
        """Returns the round number in a ``rounds/{n}/...`` key, or None for other keys."""
        if not key.startswith(self.rounds):
            return None
        head = key[len(self.rounds):].split("/", 1)[0]
        return int(head) if head.isascii() and head.isdigit() else None
