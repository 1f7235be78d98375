"""Issue 39: rollback is whole for the loops people write, whatever point of a step a kill hits.

Real etcd, real worker processes, gloo on loopback. Each case is one loop shape
(tests/workers/loop_kinds.py) in one commit mode (``commit_step()`` every step, or ``commit()``
every 3 steps), run by tests/workers/loop_shapes.py in world 2 with a waiting spare
(``ELASTIC_MAX_WORKERS=2``): two SIGKILLs, one of rank 0 and one of rank 1, at the points of a
step that ``PLANS`` gives it, each followed by a waiting spare joining in the victim's place.
The job trains every step in world 2, so its end state (parameters, buffers, optimizer
moments, scaler scale, LR, EMA copy) must equal an uninterrupted world-2 run's bit for bit, and
every sample must be in the committed ledger exactly once per epoch. It re-forms once per kill
and at no other time: a spare never makes the world re-form while it is full.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import Job

pytestmark = pytest.mark.timeout(300)  # hang guards; a case takes ~14 s idle
SCRIPT = Path(__file__).resolve().parent.parent / "workers" / "loop_shapes.py"
SAMPLES, EPOCHS, STEPS = 128, 2, 16  # global batch 16: 8 steps an epoch
ARGS = ["--samples", str(SAMPLES), "--epochs", str(EPOCHS), "--global-batch", "16",
        "--commit-every", "3"]
# Kills at step 5 (two steps after a snapshot commit) and step 8 (an epoch's last), rank 0
# and rank 1 in turn. Each commit mode runs every plan, so in each mode every point of a step
# is hit with rank 0 and with rank 1 as the victim (``micro`` only exists in the accumulation
# loop), and every loop is hit at two points (issue 39 asked for one kill at each point: the
# third kill a job once had added processes, not coverage).
KILL_STEPS = (5, 8)
# The kills are seen through their ended connections, not their leases: a long lease costs
# nothing here and keeps a worker starved at the start (20 runnable processes on 2 cores)
# from being dropped as gone, which re-formed once more than the kills explain.
LEASE_TTL_S = "10"
POINTS = ["forward", "backward", "agree", "block", "after"]  # and "micro", between micro-batches
PLANS = {"amp": [("r0", "forward"), ("r1", "block")],
         "amp-bf16": [("r1", "forward"), ("r0", "block")],
         "accumulate": [("r0", "micro"), ("r1", "micro")],
         "zero-after": [("r1", "agree"), ("r0", "after")],
         "schedule": [("r0", "agree"), ("r1", "after")],
         "norm-dropout": [("r1", "backward"), ("r0", "after")],
         "gan": [("r0", "backward"), ("r1", "block")],
         "ema": [("r1", "after"), ("r0", "block")],
         "compiled": [("r0", "backward"), ("r1", "after")]}
LOOPS = [loop for loop in PLANS if loop != "compiled"]
# Compiling on every worker and at every re-formation takes minutes on 2 cores: the case runs
# from benchmarks/rollback_compiled.py, which sets this variable.
COMPILED = pytest.param("compiled", marks=[
    pytest.mark.skipif(os.environ.get("ELASTIC_TEST_COMPILED") != "1",
                       reason="slow: run by benchmarks/rollback_compiled.py"),
    pytest.mark.timeout(900)])


def kill_plan(loop: str) -> list[tuple[str, int, str]]:
    """(victim rank, step, point) of the job's kills."""
    return [(who, step, point) for step, (who, point) in zip(KILL_STEPS, PLANS[loop])]


def run_with_kills(job: Job, plan: list[tuple[str, int, str]]) -> list[dict[str, Any]]:
    """Starts world 2 and one waiting spare per planned kill (each joins after its kill);
    returns the results of the workers that trained to the end. Fails as soon as a worker
    exits with an error."""
    started = range(2 + len(plan))
    job.start_together(started)
    # Starting is apart from the kills' deadlines: under load (20 runnable processes on 2
    # cores) importing torch in 4-6 processes at once took over 60 s.
    job.wait_until(lambda: all((job.out / f"ready-{i}").exists() for i in started)
                   or crashed(job), 150, "every worker to start")
    for n in range(len(plan)):
        job.wait_until(lambda: (job.out / f"fired-{n}").exists() or crashed(job), 60,
                       f"kill {n} {plan[n]}")
        assert not crashed(job), job.tails()
    job.wait_until(lambda: crashed(job) or all(p.poll() is not None for p in job.procs.values()),
                   60, "every worker to exit")
    assert not crashed(job), job.tails()
    for n in range(len(plan)):
        assert job.procs[_fired(job, n)["index"]].returncode == -signal.SIGKILL
    return [r for r in (job.result(i) for i, p in job.procs.items() if p.returncode == 0)
            if r["trained"]]


def crashed(job: Job) -> bool:
    """A worker exited with another status than 0 or SIGKILL's."""
    return any(p.poll() not in (None, 0, -signal.SIGKILL) for p in job.procs.values())


def _fired(job: Job, n: int) -> dict[str, Any]:
    """The marker of the job's ``n``-th planned kill."""
    return json.loads((job.out / f"fired-{n}").read_text())


@pytest.mark.parametrize("mode", ["copy-free", "snapshot"])
@pytest.mark.parametrize("loop", LOOPS + [COMPILED])
def test_a_killed_and_rejoined_run_ends_bitwise_equal_to_an_uninterrupted_one(
        make_job, references, loop, mode):
    plan = kill_plan(loop)
    # The uninterrupted world-2 run of the loop (the same for both commit modes), beside the
    # elastic job unless the other mode's case ran it.
    reference = references.start(make_job, SCRIPT, ARGS + ["--loop", loop], world=2)
    job = make_job(ARGS + ["--loop", loop] + (["--copy-free"] if mode == "copy-free" else []),
                   {"FAULTS": ",".join(f"kill:{who}:{step}:{point}"
                                       for who, step, point in plan),
                    "ELASTIC_MAX_WORKERS": "2", "ELASTIC_LEASE_TTL": LEASE_TTL_S},
                   script=SCRIPT)
    survivors = run_with_kills(job, plan)
    expected = reference.result()
    for n, (who, step, point) in enumerate(plan):
        fired = _fired(job, n)
        assert (f"r{fired['rank']}", fired["step"], fired["where"]) == (who, step, point)
        assert fired["world"] == 2
    assert len(survivors) == 2, job.tails()
    worlds = {p["world"] for i in job.procs for p in job.progress(i) if "step" in p}
    assert worlds == {2}, "a step trained in another world than the reference's"
    events = job.events()
    formed = [(e["round"], e["reason"]) for e in events if e["event"] == "round_formed"]
    assert {n for n, _ in formed} == set(range(1, 2 + len(plan))) and all(
        reason != "change" for _, reason in formed), (
        f"a re-formation without a kill: {formed}\n" + "\n".join(map(str, _story(events))))
    for result in survivors:
        assert result["step"] == STEPS
        assert result["state"] == expected["state"], (
            f"largest difference {largest_difference(result['state'], expected['state'])}")
        for epoch, seen in enumerate(result["ledger"]):
            repeated = sorted(i for i, c in Counter(seen).items() if c > 1)
            assert not repeated, f"epoch {epoch}: samples trained twice: {repeated}"
            assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: samples lost"


def test_the_kill_plans_hit_every_point_of_a_step_with_rank_0_and_rank_1_as_the_victim():
    hit = {(who, point) for loop in LOOPS for who, _, point in kill_plan(loop)}
    assert hit == {(who, point) for who in ("r0", "r1") for point in POINTS + ["micro"]}
    for loop in LOOPS + ["compiled"]:
        assert [who for who, _, _ in kill_plan(loop)] in (["r0", "r1"], ["r1", "r0"])


def _story(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events that say why a round formed: what a failing assertion prints."""
    told = {"round_formed", "failure_detected", "etcd_unreachable", "membership_changed",
            "error", "spare", "reregistered", "cut_off", "restarting_in_place", "peer_lost"}
    return [e for e in events if e["event"] in told]


def largest_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))
