"""End to end: a frozen worker is seen by its heartbeats, long before its lease ends, and a busy
one never is.

A stopped worker's kernel keeps its connections open and acknowledged, so only its missing
heartbeats tell (``peer_lost`` with ``how: frozen``); the round that leaves it out names it in
the plan's ``cut`` while it still holds its lease (6 s here, twelve times the frozen timeout). A worker
inside a long pure-Python section, a long native op, a full collection of a big heap, or on a
starved CPU keeps beating (or announced its collection): nobody reports it and the world never
changes. How soon the survivors step again is the ``recovery`` benchmark's claim.
"""

from __future__ import annotations

import json
import signal

import pytest

from tests.scenarios.test_elastic_recovery import ARGS, check_outcome
from tests.scenarios.test_fast_detection import _assert_left_out_while_leased, _first_plan_after

pytestmark = pytest.mark.timeout(120)

LEASE_TTL = "6"
SHORT = ["--epochs", "1", "--samples", "480", "--batch", "8", "--commit-every", "4"]


def test_a_stopped_worker_is_left_out_by_its_heartbeats_while_its_lease_lives(make_job):
    """What a frozen worker does once it runs again is ``test_elastic_recovery``'s; this one is
    killed once the others went on (a stopped process takes SIGKILL)."""
    job = make_job(ARGS + ["--epochs", "4", "--step-ms", "30"],
                   {"FAULTS": "stop:1:12", "ELASTIC_LEASE_TTL": LEASE_TTL})
    job.start_together(range(4))
    job.wait_until(lambda: (job.out / "fired-stop-1").exists(), 60, "the SIGSTOP to fire")
    try:
        plan, victim = _first_plan_after(job, "stop", 1)
        lost = [e for e in job.events() if e["event"] == "peer_lost"]
        assert lost and {(e["peer"], e["how"]) for e in lost} == {(victim, "frozen")}, lost
        _assert_left_out_while_leased(plan, victim, "its lease")
    finally:
        job.signal(1, signal.SIGKILL)
    assert all(job.wait_exit(i) == 0 for i in (0, 2, 3))
    check_outcome(job, [0, 2, 3])


@pytest.mark.parametrize("kind", ["python", "native", "gc", "starve"])
def test_a_busy_worker_is_never_taken_for_a_frozen_one(make_job, kind):
    """At the default frozen timeout (0.5 s): each lasts four times as long (the starved CPU
    six times), one full collection of a heap of lists longer than it (up to twice)."""
    busy_ms = 2000 if kind != "starve" else 3000
    job = make_job(SHORT + ["--step-ms", "20"],
                   {"FAULTS": f"{kind}:1:8", "SLOW_STEP_MS": str(busy_ms),
                    "ELASTIC_LEASE_TTL": LEASE_TTL})
    job.start_together(range(3))
    for i in range(3):
        assert job.wait_exit(i) == 0
    report = json.loads((job.out / "busy-1.json").read_text())
    if kind == "starve":  # the worker trains on, starved, while its sibling runs
        starved = job.out / "starved-1"  # written as the sibling ends, maybe after the worker
        job.wait_until(lambda: starved.exists() and starved.read_text(), 30,
                       "the starving sibling's report")
        report["seconds"] = float(starved.read_text())
    assert report.get("collect_s", report["seconds"]) > (0.5 if kind == "gc" else 1.9), report
    lost = [e for e in job.events() if e["event"] in ("peer_lost", "failure_detected")]
    assert not lost, f"a {kind} section was taken for a failure: {lost}"
    assert {e["round"] for e in job.events() if e["event"] == "round_formed"} == {1}
    params = [job.result(i)["params"] for i in range(3)]
    assert params[0] == params[1] == params[2]
