"""In-memory N -> M resharding of an FSDP2 job against DCP through disk and a restart, in one run.

Usage: ``python -m benchmarks reshard [--small | --width W --layers L] [--ranks N] [--join-only]
[--out PATH]``
and ``python -m benchmarks reshard --steady [--rounds R --steps S]``.

Ours: one embedded etcd and 8 workers (``reshard_worker.py``: ~101M parameters, AdamW, gloo on
loopback, a commit every 10 steps, ``buddies=1``). Past step 12 the ranks 1 and 4 (not each
other's buddies: the ring is r -> r+1) are SIGKILLed; the 6 survivors reshard in memory and go
on; then 2 workers join and the job goes back to 8. Reported, from the workers' events
(``reshard_timeline``), for the survivor that was ready last:
- recovery: SIGKILL -> ``resumed`` at 6, split into detection, rendezvous, group, the parts of
  the sharded rebuild (choosing the commit, mesh, ``parallelize``, state dict, moves, load, the
  formation's commit with its buddy copies), then the first step at 6 on its own;
- the join pause: a survivor's last step at 6 -> ``resumed`` at 8, split the same way (its
  first phase is the commit that saw the joiners), then the first step at 8; and the job's:
  the last survivor's last step before that formation -> every member, joiners too,
  ``resumed`` at 8;
- the reshard phase alone, bytes moved against the minimum (one ``resharded`` event's: each
  holds the whole plan), resident memory per rank with and without buddy copies.

Anchor, the path users have today (same model, same run; ``reshard_anchor``): DCP save at 8 to
local disk, a restart of 6 fresh processes up to "model built" (process start, import,
``init_process_group``, FSDP2 model and optimizer), then DCP load at 6. Neither side counts a
step; the anchor counts no failure detection.

``--steady``: the same FSDP2 loop plainly (``reshard_steady``) and under ``ElasticState`` (a
commit every 10 steps with buddy copies), taking turns, ``--rounds`` runs each; the ratio of the
median throughputs. Default 4 ranks, width 1024, 8 layers (8.4M parameters) so that it ends in a
few minutes. ``--small`` (~2M parameters) runs on a loaded machine; the figures of the claim come
from the default sizes on an idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import reshard_anchor  # noqa: E402
import reshard_steady  # noqa: E402
import reshard_timeline as timeline  # noqa: E402
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402

WORKER = str(HERE / "reshard_worker.py")
WAIT_S = 900
POLL_S = 0.25  # how often the waits read the records (the figures come from those)


class Job:
    """One embedded etcd and the benchmark's workers (``reshard_worker.py``), stopped by PID."""

    def __init__(self, size: list[str], buddies: int, min_workers: int,
                 steps: int | None) -> None:
        self.out = Path(tempfile.mkdtemp(prefix="reshard-"))
        self.procs = harness.Procs(self.out)
        self.etcd = EmbeddedEtcd().start()
        self.env = harness.env_for(ELASTIC_ETCD=self.etcd.url, ELASTIC_JOB_ID=f"reshard-{buddies}",
                                   ELASTIC_LEASE_TTL="5", ELASTIC_LOG_DIR=str(self.out / "events"),
                                   ELASTIC_MIN_WORKERS=str(min_workers))
        self.command = [sys.executable, WORKER, "--out", str(self.out), "--buddies",
                        str(buddies), *size]
        if steps is not None:
            self.command += ["--steps", str(steps)]
        self.started: list[float] = []

    def start(self, n: int) -> None:
        for _ in range(n):
            self.started.append(time.time())
            self.procs.start(self.command, self.env)

    def progress(self) -> list[dict]:
        return harness.read_progress(self.out)

    def events(self) -> list[dict]:
        return timeline.read_events(self.out / "events")

    def stop(self) -> None:
        self.procs.kill_all()
        self.etcd.stop()


def _wait_for(predicate, timeout: float, what: str):
    """``harness.wait_for`` at a slow poll: every figure here is read from the workers' own
    records, so a fast poll would only take CPU from the ranks whose pause it measures."""
    return harness.wait_for(predicate, timeout, what, poll_s=POLL_S)


def _first_at(job: Job, world: int, after: float) -> dict:
    return _wait_for(lambda: next((p for p in job.progress()
                                   if p["t"] > after and p["world"] == world), None),
                     WAIT_S, f"a step at world {world}")


def _splits(job: Job, pids: set[int], starts: dict[int, float], world: int,
            trigger: str) -> dict[int, dict[str, float]]:
    """Each survivor's phases; every one of them, or the run is refused (a pause read from
    some survivors only would read low)."""
    events, progress = job.events(), job.progress()
    found = {pid: timeline.split(events, progress, pid, starts[pid], world, trigger)
             for pid in pids}
    missing = sorted(pid for pid, s in found.items() if s is None)
    if missing:
        raise RuntimeError(f"no phases at world {world} for the survivors {missing}: "
                           f"their events or first step there were not found in {job.out}")
    return found


def _prefixed(prefix: str, phases: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}_{name}": value for name, value in phases.items() if value}


def run_ours(size: list[str], ranks: int) -> dict:
    """The kill-2-then-join-2 job: recovery and join pause split by phase (the last survivor's)."""
    job = Job(size, 1, ranks - 2, None)
    try:
        job.start(ranks)
        _wait_for(lambda: harness.steps_of(job.out, 12, ranks), WAIT_S,
                  f"{ranks} workers at step 12")
        rss_at_full = max(p["rss_mb"] for p in job.progress() if p["world"] == ranks)
        pids = {p["rank"]: p["pid"] for p in job.progress() if p["world"] == ranks}
        times = [p["t"] for p in job.progress() if p["pid"] == pids[0]]
        steady = [b - a for a, b in zip(times, times[1:])]
        killed_at = time.time()
        for rank in (1, 4):  # not each other's buddies (the ring is r -> r + 1)
            os.kill(pids[rank], signal.SIGKILL)
        small = ranks - 2
        first_small = _first_at(job, small, killed_at)
        survivors = set(pids.values()) - {pids[1], pids[4]}
        _wait_for(lambda: all(timeline.resumed_at(job.events(), pid, small, killed_at)
                              for pid in survivors), WAIT_S, "every survivor resumed")
        _wait_for(lambda: harness.steps_of(job.out, first_small["step"] + 12, small),
                  WAIT_S, f"12 steps at {small}")
        kill = _splits(job, survivors, {pid: killed_at for pid in survivors}, small,
                       "failure_detected")
        shrink = [e for e in job.events() if e["event"] == "resharded" and e["t"] > killed_at]
        joined_at = time.time()
        job.start(2)
        first_full = _first_at(job, ranks, joined_at)
        _wait_for(lambda: all(timeline.resumed_at(job.events(), pid, ranks, joined_at)
                              for pid in survivors), WAIT_S, "every survivor back")
        # every survivor's first step since the join (the steps at ``ranks`` before the kill
        # do not count): the pause is the last survivor's, none left out
        _wait_for(lambda: all(any(p["pid"] == pid and p["world"] == ranks
                                  and p["t"] > joined_at for p in job.progress())
                              for pid in survivors),
                  WAIT_S, f"every survivor's first step at {ranks}")
        events = job.events()
        # the pause of the formation that reached ``ranks``: joiners that asked apart reach
        # it through a formation at ``small + 1`` and steps there, which are not a pause
        starts = {pid: timeline.last_step_before(
            job.progress(), pid, None, timeline.resumed_at(events, pid, ranks, joined_at))
            for pid in survivors}
        via = sorted({e["world_size"] for e in events if e["event"] == "resumed"
                      and e["pid"] == min(survivors) and e["t"] > joined_at})
        join = _splits(job, survivors, starts, ranks, "membership_changed")
        grow = [e for e in events if e["event"] == "resharded" and e["t"] > joined_at
                and e["to_world"] == ranks]
        joiners = [e for e in events if e["event"] == "joined" and e["t"] > joined_at]
        # the job's pause: the last survivor's last step before the formation that reached
        # ``ranks`` -> every member, the joiners too, ready there (a joiner ready last delays
        # the first step); it can read below one survivor's pause that stepped earlier
        ready = [timeline.resumed_at(events, pid, ranks, joined_at)
                 for pid in survivors | {e["pid"] for e in joiners}]
        all_ready = (max(ready) - max(starts.values())
                     if None not in ready and None not in starts.values() else None)
        kill_last = timeline.slowest(kill)[1] if kill else {}
        join_last = timeline.slowest(join)[1] if join else {}
        survivor = min(survivors)
        times = [p["t"] for p in job.progress() if p["pid"] == survivor and p["world"] == small]
        steady_small = [b - a for a, b in zip(times[1:], times[2:])]  # not the first step
        return {
            f"kill_to_first_step_at_{small}_s": first_small["t"] - killed_at,
            f"recovery_to_ready_at_{small}_s": kill_last.get("ready_s"),
            **_prefixed("recovery", kill_last),
            f"reshard_{ranks}_to_{small}_s": max(e["reshard_s"] for e in shrink),
            f"bytes_moved_{ranks}_to_{small}": max(e["bytes_moved"] for e in shrink),
            f"bytes_minimum_{ranks}_to_{small}": max(e["bytes_minimum"] for e in shrink),
            "join_pause_s": join_last.get("ready_s"),
            "join_formations_to_full": via,
            "join_all_ready_s": all_ready,
            **_prefixed("join", join_last),
            "joiner_start_to_registered_s": (min(e["t"] for e in joiners) - joined_at
                                             if joiners else None),
            f"join_to_first_step_at_{ranks}_s": first_full["t"] - joined_at,
            f"reshard_{small}_to_{ranks}_s": max((e["reshard_s"] for e in grow), default=None),
            f"bytes_moved_{small}_to_{ranks}": max((e["bytes_moved"] for e in grow), default=0),
            f"bytes_minimum_{small}_to_{ranks}": max((e["bytes_minimum"] for e in grow),
                                                     default=0),
            "steady_step_s": statistics.median(steady) if steady else None,
            f"steady_step_at_{small}_s": (statistics.median(steady_small) if steady_small
                                          else None),
            f"rss_mb_max_at_{ranks}": rss_at_full,
        }
    finally:
        job.stop()


def run_plain_job(size: list[str], buddies: int, ranks: int, steps: int) -> Job:
    """A job of ``ranks`` workers that trains ``steps`` steps and stops (still to be stopped)."""
    job = Job(size, buddies, ranks, steps)  # no change of world: all of them form it
    job.start(ranks)
    return job


def rss_without_buddies(size: list[str], ranks: int) -> float:
    job = run_plain_job(size, 0, ranks, 14)
    try:
        _wait_for(lambda: harness.steps_of(job.out, 12, ranks), WAIT_S,
                  f"{ranks} workers at step 12")
        return max(p["rss_mb"] for p in job.progress() if p["world"] == ranks)
    finally:
        job.stop()


def elastic_stamps(size: list[str], ranks: int, steps: int, commit_every: int = 10
                   ) -> tuple[list[float], list[float]]:
    """Rank 0's step end times in a job of ``ranks`` workers, ``buddies=1``, a commit every
    ``commit_every`` steps (0: only the formation's), and how long each of its commits in the
    loop took on the training thread."""
    job = run_plain_job(size + ["--commit-every", str(commit_every)], 1, ranks, steps)
    try:
        _wait_for(lambda: harness.steps_of(job.out, steps, ranks), WAIT_S,
                  f"{ranks} workers at step {steps}")
        mine = [p for p in job.progress() if p["rank"] == 0 and p["world"] == ranks]
        commits = {p["commit_s"] for p in mine if p.get("commit_s") is not None}
        return [p["t"] for p in mine], sorted(commits)
    finally:
        job.stop()


def steady(size: list[str], ranks: int, rounds: int, steps: int, split: bool = False) -> dict:
    """The plain FSDP2 loop and the same loop under ElasticState, taking turns, ``rounds``
    times each; the ratio of the median throughputs (target >= 0.97). ``split`` adds ours
    without commits in the loop, to tell the commits' cost from the rest of ours."""
    width, layers = int(size[1]), int(size[3])
    sides = ["plain", "ours"] + ["ours_no_commits"] * split
    rates: dict[str, list[float]] = {side: [] for side in sides}
    commit_s: list[float] = []
    for turn in range(rounds):
        for side in sides[turn % len(sides):] + sides[:turn % len(sides)]:
            if side == "plain":
                stamps = reshard_steady.plain_run(width, layers, ranks, steps, 16,
                                                  meta="--full-init" not in size)
            else:
                stamps, commits = elastic_stamps(size, ranks, steps, 10 if side == "ours" else 0)
                commit_s += commits
            rates[side].append(reshard_steady.throughput(stamps, 10))
            print(f"turn {turn} {side}: {rates[side][-1]:.3f} steps/s", flush=True)
    result = {"steady_ranks": ranks, "steady_steps": steps, "steady_rounds": rounds,
              **{f"{side}_steps_per_s": rates[side] for side in sides},
              "ours_commit_s_median": statistics.median(commit_s) if commit_s else None}
    for side in sides[1:]:
        tag = "" if side == "ours" else f"_{side}"
        result[f"steady_ratio_of_medians{tag}"] = (statistics.median(rates[side])
                                                  / statistics.median(rates["plain"]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--small", action="store_true", help="~2M parameters (a loaded machine)")
    parser.add_argument("--width", type=int, help="layer width (default 2900; --small 400)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steady", action="store_true",
                        help="only the steady state: the plain FSDP2 loop against ours, "
                             "taking turns (default 4 ranks, width 1024, 8 layers)")
    parser.add_argument("--ranks", type=int, help="ranks (default 8; --steady 4)")
    parser.add_argument("--rounds", type=int, default=3, help="--steady: turns of each side")
    parser.add_argument("--steps", type=int, default=40, help="--steady: steps of each run")
    parser.add_argument("--split", action="store_true",
                        help="--steady: also ours without commits in the loop")
    parser.add_argument("--full-init", action="store_true",
                        help="every rank builds and initialises the whole model (not on meta)")
    parser.add_argument("--join-only", action="store_true",
                        help="only the kill-and-join job (no memory-without-buddies job, "
                             "no DCP anchor): repeated runs of the recovery and join pause")
    parser.add_argument("--out", type=Path, default=HERE / "runs" / "reshard.json")
    args = parser.parse_args()
    if args.steady and args.join_only:
        parser.error("--join-only is a part of the kill-and-join run; --steady has none")
    if args.steady:
        width, layers = (args.width, args.layers) if args.width else (1024, 8)
        ranks = args.ranks or 4
    else:
        width, layers = args.width or (400 if args.small else 2900), args.layers
        ranks = args.ranks or 8
    params = layers * (width * width + width)
    print(f"model: {params / 1e6:.1f}M parameters, {3 * params * 4 / 2**20:.0f} MiB with AdamW, "
          f"{ranks} ranks", flush=True)
    result: dict = {"params": params, "ranks": ranks, "small": args.small,
                    "full_init": args.full_init}
    size = ["--width", str(width), "--layers", str(layers)] + ["--full-init"] * args.full_init
    if args.steady:
        result.update(steady(size, ranks, args.rounds, args.steps, args.split))
    else:
        result.update(run_ours(size, ranks))
        print(json.dumps(result), flush=True)
        if not args.join_only:
            result[f"rss_mb_max_at_{ranks}_without_buddies"] = rss_without_buddies(size, ranks)
            result.update(reshard_anchor.run(width, layers, ranks, ranks - 2,
                                             not args.full_init))
    for key, value in result.items():
        print(f"{key:>40}: {value:.3f}" if isinstance(value, float) else f"{key:>40}: {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
