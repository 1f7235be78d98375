"""When a crashed worker's replacement starts (``Replacements``), against a real etcd: the
job's rounds are written as the coordinator writes them (the plan, then the news)."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.news import RoundNews
from elastic.cluster.rounds.plan import Plan
from elastic.launch.replacements import Replacement, Replacements
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(60)
SLOT = Replacement(local_rank=1, standby=False)



def write_round(client: EtcdClient, keys: JobKeys, n: int, ranks: list[str]) -> None:
    client.put(keys.plan(n), Plan(round=n, ranks=ranks).to_json())
    client.put(keys.news, RoundNews(n).to_json())


def held(client: EtcdClient, job: str, wait_s: float = 30,
         connect_s: float = 0.2) -> tuple[Replacements, threading.Event]:
    wake = threading.Event()
    replacements = Replacements(client, JobKeys(job), wake, timedelta(seconds=wait_s),
                                timedelta(seconds=connect_s))
    replacements.start()
    return replacements, wake


def test_a_replacement_waits_until_the_survivors_formed_a_newer_round(client):
    job = f"replace-{os.getpid()}"
    keys = JobKeys(job)
    write_round(client, keys, 3, ["a-1-x", "dead-2-y", "c-3-z"])
    replacements, wake = held(client, job, connect_s=1.0)
    try:
        assert replacements.hold(SLOT, ["dead-2-y"])
        assert replacements.due() == [] and replacements.holding
        write_round(client, keys, 4, ["a-1-x", "c-3-z"])  # the survivors, without it
        assert wake.wait(10)
        assert replacements.due() == []  # they connect and move the state first
        assert 0 < replacements.wait_s(longest=5.0) <= 1.0
        assert poll_until(lambda: replacements.due() == [(SLOT, "the others formed round 4")],
                          5)
        assert not replacements.holding
    finally:
        replacements.stop()


def test_a_replacement_starts_at_once_when_nobody_is_left_to_re_form_or_it_was_in_no_round(
        client):
    job = f"replace-now-{os.getpid()}"
    keys = JobKeys(job)
    replacements, _ = held(client, job)
    try:
        assert not replacements.hold(SLOT, ["dead-2-y"])  # no round yet: it died starting
        write_round(client, keys, 1, ["dead-2-y"])
        assert poll_until(lambda: replacements.hold(SLOT, ["dead-2-y"]) is False, 5)
        write_round(client, keys, 2, ["a-1-x", "c-3-z"])  # they went on without it already
        assert poll_until(lambda: replacements.hold(SLOT, ["dead-2-y"]) is False, 5)
        assert not replacements.holding
    finally:
        replacements.stop()


def test_a_replacement_starts_after_its_wait_when_the_survivors_cannot_re_form(client):
    job = f"replace-wait-{os.getpid()}"
    write_round(client, JobKeys(job), 5, ["a-1-x", "dead-2-y"])
    replacements, _ = held(client, job, wait_s=0.3)
    try:
        assert poll_until(lambda: replacements.hold(SLOT, ["dead-2-y"]), 5)
        assert 0 < replacements.wait_s(longest=1.0) <= 0.3
        assert poll_until(lambda: replacements.due() == [
            (SLOT, "the others did not re-form within 0.3 s")], 5)
    finally:
        replacements.stop()
