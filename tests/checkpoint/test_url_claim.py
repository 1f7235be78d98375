"""A job's claim on its checkpoint URL: another job is refused while the claim is fresh, the
same job resumes, and a dead job's stale claim is taken over; on a local directory and on
s3:// (a moto server on 127.0.0.1: the first claim is a conditional create there)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from elastic.checkpoint import CheckpointHeldError, UrlClaim
from elastic.checkpoint.backend import Storage, resolve_filesystem

STALE = timedelta(seconds=60)
Where = tuple[str, dict[str, Any] | None]  # a checkpoint URL and its storage options


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    """A checkpoint URL and its storage options."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    return request.getfixturevalue("s3_url"), request.getfixturevalue("s3_server")


def claim(where: Where, job_id: str, clock: Clock) -> UrlClaim:
    fs, root = resolve_filesystem(*where)
    return UrlClaim(Storage(fs, root), job_id, STALE, clock)


def test_another_job_is_refused_in_one_line_naming_the_holder_while_its_claim_is_fresh(
        where: Where) -> None:
    clock = Clock()
    claim(where, "job-a", clock).acquire()
    clock.now += 59
    with pytest.raises(CheckpointHeldError) as refused:
        claim(where, "job-b", clock).acquire()
    said = str(refused.value)
    assert "\n" not in said
    assert "in use by job 'job-a'" in said and "heartbeat 59 s ago" in said, said
    assert "--job-id job-a" in said and "ELASTIC_CHECKPOINT_CLAIM" in said, said


def test_the_same_job_resumes_on_its_own_claim(where: Where) -> None:
    clock = Clock()
    claim(where, "job-a", clock).acquire()
    claim(where, "job-a", clock).acquire()


def test_a_stale_claim_of_a_dead_job_is_taken_over_and_its_renewal_then_fails(
        where: Where) -> None:
    clock = Clock()
    dead = claim(where, "job-a", clock)
    dead.acquire()
    clock.now += 61
    successor = claim(where, "job-b", clock)
    successor.acquire()
    assert successor.holder().job_id == "job-b"
    assert not dead.renew()  # it woke up: the URL is no longer its own
    assert successor.renew()


def test_a_released_claim_lets_another_job_start_at_once(where: Where) -> None:
    clock = Clock()
    first = claim(where, "job-a", clock)
    first.acquire()
    first.release()
    claim(where, "job-b", clock).acquire()
