"""Goodput: the soak job's useful steps per second under one mixed fault every S seconds,
divided by the same job's steps per second with no faults, the two taking turns in one run.

Usage: ``.venv/bin/python benchmarks/soak.py --fault-every 60 --duration 1800 [--turns 1]``
(``python -m benchmarks goodput``). Each turn is one job of ``soak_worker.py`` with 4 workers on
a fresh embedded etcd, measured for ``--duration`` seconds from 5 s after all 4 first train; the
turns go fault-free, faulty, fault-free, ... (``--turns`` faulty ones), so a drift of the
machine's speed cancels: each faulty turn is compared with the mean of its two neighbours.

In a faulty turn the i-th fault fires at a seeded time in [(i + 1/4) S, (i + 3/4) S) (mean
interval S, the last at least S/4 before the end). Kinds: ``kill`` (SIGKILL), ``stop`` (SIGSTOP
past the lease, then SIGCONT: it is fenced and rejoins), ``term`` (SIGTERM: it leaves at its
next commit), ``replace`` (SIGKILL and a new worker started at once, as a launcher does) and
``join`` (a new worker). With fewer than 4 workers (started or training) the next fault is a
join; otherwise one of the other four, seeded, at a worker that has trained.

A ``replace`` forks the new worker from a warm-start template, as ``elastic run`` does
(``soak.Soak(warm=True)``); a ``join`` is a new machine: a cold process.

Useful steps are counted from the event log, not from a step counter: the job's ``step`` is
committed state (a rolled-back batch takes its count with it) and rank 0 records it in a
``progress`` event at every commit (``ELASTIC_PROGRESS`` 1 ms). Of those events only the kept
line counts: an event whose step a later event undercuts was rolled back. ``goodput`` weighs
each useful step by the world that took it (its samples: a kill leaves 3 workers until the
next join, and 3 workers step faster than 4 on a small machine, so unweighted steps flatter);
``goodput_steps`` counts steps alone.

``goodput`` is measured against what the workers present (``slots``) could have trained: all of
them at the fault-free turns' rate, fewer at that rate times the ratio of the two worlds' steady
rates in the faulty turn (``expected``). A worker's slot closes when it is killed or leaves
(SIGTERM) and while it is frozen (SIGSTOP to SIGCONT: the fault itself); a joiner's opens when
it asks to join (its ``joined`` event: starting a new machine's process is not training lost); a
replaced worker's never closes (its replacement's start is charged). So a kill costs what the
survivors lose (the pause, the steps rolled back), not the missing quarter of the job until the
next join, which no framework could train with; ``goodput_samples`` is the same ratio against
the full job's rate, which charges that quarter too. The training time lost to a fault is what
its stretch's (to the next fault, or the end) workers could have trained less its useful
samples, in seconds of the full job's fault-free rate. ``python goodput.py REPORT.json``
recomputes a saved report from its turns' log folders.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from elastic.launch.embedded_etcd import EmbeddedEtcd

from soak import Soak, percentile, read_jsonl

WARMUP_S = 5.0  # measured from 5 s after all workers first train
FORM_TIMEOUT_S = 180.0
PROGRESS_EVERY_S = "0.001"  # one progress event per commit
STEADY_AFTER_S = 1.0  # a world's steady rate is counted from 1 s after a recovery
BATCH = 16  # soak_worker.py's samples per worker and step
WORKER_FAULTS = ("kill", "stop", "term", "replace")


def kept_line(progress: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The progress events whose step was kept: drops each one a later event undercuts."""
    kept: list[dict[str, Any]] = []
    floor = float("inf")
    for event in reversed(progress):
        if event["step"] <= floor:
            kept.append(event)
            floor = event["step"]
    return kept[::-1]


def useful_at(line: list[dict[str, Any]], t: float) -> tuple[int, float]:
    """(committed step, committed samples) of the kept line at time ``t``."""
    step, samples, last = 0, 0.0, 0
    for event in line:
        if event["t"] > t:
            break
        samples += (event["step"] - last) * event["world_size"]
        step = last = event["step"]
    return step, samples


def schedule(rng: random.Random, every_s: float, duration_s: float) -> list[float]:
    """Offsets from the window's start of the faults: one in each slot of ``every_s``."""
    return [every_s * (i + rng.uniform(0.25, 0.75)) for i in range(int(duration_s // every_s))]


def choose(rng: random.Random, live: int, workers: int) -> str:
    return "join" if live < workers else rng.choice(WORKER_FAULTS)


def run_turn(faulty: bool, args: Any, rng: random.Random) -> dict[str, Any]:
    """One job for ``args.duration`` seconds, with faults or without; its events, analysed."""
    root = Path(tempfile.mkdtemp(prefix="elastic-goodput-"))
    (root / "etcd").mkdir()
    etcd = EmbeddedEtcd(data_dir=str(root / "etcd")).start()
    soak = Soak(root, etcd, args.workers, {"ELASTIC_PROGRESS": PROGRESS_EVERY_S}, warm=True)
    try:
        t0 = wait_all_training(soak, args.workers) + WARMUP_S
        soak.pause.wait(max(0.0, t0 - time.time()))
        if faulty:
            for offset in schedule(rng, args.fault_every, args.duration):
                soak.pause.wait(max(0.0, t0 + offset - time.time()))
                soak.fire(choose(rng, len(soak.live), args.workers), rng, trained(soak))
        soak.pause.wait(max(0.0, t0 + args.duration - time.time()))
        t1 = time.time()
        ended_in_time, left_behind = soak.finish(timeout_s=180)
    finally:
        for proc in soak.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        soak.close()
        etcd.stop()
    return analyse(soak, t0, t1, ended_in_time, left_behind, args.workers)


def progress_events(root: Path) -> list[dict[str, Any]]:
    files = sorted((root / "events").glob("*.jsonl"))
    return [e for e in read_jsonl(files) if e["event"] == "progress" and "step" in e]


def trained(soak: Soak) -> list:
    """The live workers that have trained: a worker fault never hits one still starting (under
    load a joiner can take 30 s to import torch; killing it would cost the job nothing)."""
    events = read_jsonl(sorted((soak.root / "events").glob("*.jsonl")))
    pids = {e["pid"] for e in events if e["event"] == "resumed"}
    return [proc for proc in soak.live if proc.pid in pids]


def wait_all_training(soak: Soak, workers: int) -> float:
    """When rank 0 first committed in a world of all ``workers`` (bounded)."""
    deadline = time.monotonic() + FORM_TIMEOUT_S
    while time.monotonic() < deadline:
        full = [e for e in progress_events(soak.root) if e["world_size"] == workers]
        if full:
            return full[0]["t"]
        soak.pause.wait(0.5)
    raise TimeoutError(f"the {workers} workers did not all train within {FORM_TIMEOUT_S:.0f} s:"
                       f" see the worker logs in {soak.root}")


def slot_changes(faults: list[dict[str, Any]],
                 joined: dict[int, float]) -> list[tuple[float, int]]:
    """When workers' slots close (-1) and open (+1), from the faults and the joiners' first
    ``joined`` events (by pid); see the module's docstring."""
    changes = []
    for fault in faults:
        if fault["kind"] in ("kill", "term"):
            changes.append((fault["t"], -1))
        elif fault["kind"] == "stop":
            changes += [(fault["t"], -1), (fault["woken"], 1)]
        elif fault["kind"] == "join" and fault.get("pid") in joined:
            changes.append((joined[fault["pid"]], 1))
    return sorted(changes)


def slot_time(changes: list[tuple[float, int]], slots: int, a: float,
              b: float) -> dict[str, float]:
    """Seconds in [a, b] spent with each number of workers present (keys: str, as in JSON):
    ``slots`` at the start of the turn, then each change at its time."""
    spent: dict[str, float] = {}
    last = a
    for t, delta in changes:
        if t > a:
            spent[str(slots)] = spent.get(str(slots), 0.0) + min(t, b) - last
            last = min(t, b)
        slots += delta
    spent[str(slots)] = spent.get(str(slots), 0.0) + b - last
    return {k: v for k, v in spent.items() if v > 0}


def steady_rates(line: list[dict[str, Any]], faults: list[dict[str, Any]]) -> dict[str, float]:
    """Samples/s by world size (str keys) between kept commits, outside every fault's window
    (from the fault to 1 s after its recovery, or to the next fault when it had none)."""
    windows = [(f["t"], f["t"] + f["recovery_s"] + STEADY_AFTER_S
                if f["recovery_s"] is not None else f["end"]) for f in faults]
    totals: dict[str, list[float]] = {}
    for a, b in zip(line, line[1:]):
        if a["world_size"] != b["world_size"] or any(
                lo < b["t"] and a["t"] < hi for lo, hi in windows):
            continue
        n, d = totals.setdefault(str(b["world_size"]), [0.0, 0.0])
        totals[str(b["world_size"])] = [n + (b["step"] - a["step"]) * b["world_size"] * BATCH,
                                        d + b["t"] - a["t"]]
    return {w: n / d for w, (n, d) in totals.items() if d > 0}


def analyse(soak: Soak, t0: float, t1: float, ended_in_time: bool,
            left_behind: int, workers: int) -> dict[str, Any]:
    events = read_jsonl(sorted((soak.root / "events").glob("*.jsonl")))
    line = kept_line(progress_events(soak.root))
    (s0, n0), (s1, n1) = useful_at(line, t0), useful_at(line, t1)
    resumed = [e["t"] for e in events if e["event"] == "resumed"]
    joined: dict[int, float] = {}
    for e in events:
        if e["event"] == "joined":
            joined.setdefault(e["pid"], e["t"])
    changes = slot_changes(soak.faults, joined)
    faults = []
    for fault, end in zip(soak.faults, [f["t"] for f in soak.faults[1:]] + [t1]):
        after = [t for t in resumed if fault["t"] < t < end]
        faults.append({**fault, "end": end,
                       "slot_time": slot_time(changes, workers, fault["t"], end),
                       "recovery_s": after[0] - fault["t"] if after else None,
                       "samples": (useful_at(line, end)[1] - useful_at(line, fault["t"])[1])
                       * BATCH})
    result = json.loads((soak.root / "result.json").read_text()) \
        if (soak.root / "result.json").exists() else {}
    audit = result.get("audit")
    return {
        "faulty": bool(soak.faults), "t0": t0, "seconds": t1 - t0,
        "useful_steps": s1 - s0, "steps_per_s": (s1 - s0) / (t1 - t0),
        "samples_per_s": (n1 - n0) * BATCH / (t1 - t0),
        "slot_time": slot_time(changes, workers, t0, t1), "workers": workers,
        "steady_samples_per_s": steady_rates(line, faults),
        "rolled_back_events": len(progress_events(soak.root)) - len(line),
        "faults": faults,
        "samples_duplicated": sum(row[1] for row in audit) if audit else None,
        "samples_lost": sum(row[2] for row in audit) if audit else None,
        "hangs": sum(1 for f in faults if f["kind"] in WORKER_FAULTS and f["recovery_s"] is None)
        + (0 if ended_in_time else 1),
        "processes_left_behind": left_behind, "log_dir": str(soak.root),
    }


def by_kind(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Recovery and training time lost per fault, by kind, against each turn's reference."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for turn in turns:
        for fault in turn["faults"]:
            fault["lost_s"] = (expected(turn, fault["slot_time"]) - fault["samples"]) \
                / turn["reference_samples"]
            rows.setdefault(fault["kind"], []).append(fault)
    kinds = {}
    for kind, mine in sorted(rows.items()):
        rec = [f["recovery_s"] for f in mine if f["recovery_s"] is not None]
        lost = [f["lost_s"] for f in mine]
        kinds[kind] = {"fired": len(mine), "recovered": len(rec),
                       "recovery_p50_s": statistics.median(rec) if rec else None,
                       "recovery_max_s": max(rec) if rec else None,
                       "lost_median_s": statistics.median(lost), "lost_p95_s":
                       percentile(lost, 0.95), "lost_total_s": sum(lost)}
    return kinds


def table(report: dict[str, Any]) -> str:
    """The result as Markdown tables, as RESULTS.md takes them."""
    f = report
    lines = [f"Goodput, {f['workers']} workers, one mixed fault every {f['fault_every_s']:g} s, "
             f"{f['turns']} faulty turn(s) of {f['duration_s']:g} s between fault-free ones:",
             "", "| | faulty | fault-free (neighbours) | goodput |", "|---|---|---|---|",
             f"| useful samples/s against what the workers present could train "
             f"({f['capacity']:.3f} of the full job's rate) | {f['samples_per_s']:.0f} | "
             f"{f['reference_samples_per_s'] * f['capacity']:.0f} | **{f['goodput']:.4f}** |",
             f"| useful samples/s (steps x world) | {f['samples_per_s']:.0f} | "
             f"{f['reference_samples_per_s']:.0f} | {f['goodput_samples']:.4f} |",
             f"| useful steps/s | {f['steps_per_s']:.2f} | {f['reference_steps_per_s']:.2f} | "
             f"{f['goodput_steps']:.4f} |",
             "", "| fault | fired | recovered | recovery p50 | lost per fault: median | p95 |",
             "|---|---|---|---|---|---|"]
    for kind, k in f["by_kind"].items():
        p50 = f"{k['recovery_p50_s']:.2f} s" if k["recovery_p50_s"] is not None else "-"
        lines.append(f"| {kind} | {k['fired']} | {k['recovered']} | {p50} | "
                     f"{k['lost_median_s']:.2f} s | {k['lost_p95_s']:.2f} s |")
    lines.append(f"\nHangs {f['hangs']}, samples lost {f['samples_lost']}, duplicated "
                 f"{f['samples_duplicated']}, processes left behind {f['processes_left_behind']}.")
    return "\n".join(lines)


def expected(turn: dict[str, Any], spent: dict[str, float]) -> float:
    """The samples the workers present could have trained in ``spent`` (seconds by number of
    workers present): the fault-free turns' rate for all of them; for fewer, that rate times
    the ratio of the two worlds' steady rates in this turn (3 workers of this job train more
    samples each than 4: a smaller ring), or in proportion when this turn has no such ratio."""
    full, steady = turn["reference_samples"], turn["steady_samples_per_s"]
    top = str(turn["workers"])
    total = 0.0
    for slots, seconds in spent.items():
        if slots in steady and top in steady:
            rate = full * steady[slots] / steady[top]
        else:
            rate = full * int(slots) / turn["workers"]
        total += rate * seconds
    return total


def report_of(turns: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    """The report of a run's turns (fault-free, faulty, fault-free, ...)."""
    free, faulty = turns[0::2], turns[1::2]
    for i, turn in enumerate(faulty):
        turn["reference"] = (free[i]["steps_per_s"] + free[i + 1]["steps_per_s"]) / 2
        turn["reference_samples"] = (free[i]["samples_per_s"] + free[i + 1]["samples_per_s"]) / 2
        turn["expected_samples"] = expected(turn, turn["slot_time"])
        turn["goodput"] = turn["samples_per_s"] * turn["seconds"] / turn["expected_samples"]
        turn["goodput_samples"] = turn["samples_per_s"] / turn["reference_samples"]
        turn["goodput_steps"] = turn["steps_per_s"] / turn["reference"]
    seconds = sum(t["seconds"] for t in faulty)
    useful = sum(t["samples_per_s"] * t["seconds"] for t in faulty)
    report: dict[str, Any] = {
        "workers": args.workers, "fault_every_s": args.fault_every, "duration_s": args.duration,
        "turns": args.turns, "seed": args.seed,
        "steps_per_s": sum(t["useful_steps"] for t in faulty) / seconds,
        "reference_steps_per_s": statistics.mean(t["reference"] for t in faulty),
        "samples_per_s": useful / seconds,
        "reference_samples_per_s": statistics.mean(t["reference_samples"] for t in faulty),
        "goodput": useful / sum(t["expected_samples"] for t in faulty),
    }
    report["capacity"] = sum(t["expected_samples"] for t in faulty) \
        / sum(t["reference_samples"] * t["seconds"] for t in faulty)
    report["goodput_samples"] = report["samples_per_s"] / report["reference_samples_per_s"]
    report["goodput_steps"] = report["steps_per_s"] / report["reference_steps_per_s"]
    report["by_kind"] = by_kind(faulty)
    for key in ("hangs", "processes_left_behind", "samples_lost", "samples_duplicated"):
        values = [t[key] for t in turns]
        report[key] = None if None in values else sum(values)
    report["table"] = table(report)
    report["turns_detail"] = turns
    return report


def main(args: Any) -> None:
    rng = random.Random(args.seed)
    turns = []
    for i in range(2 * args.turns + 1):
        print(f"{time.strftime('%H:%M:%S')} turn {i}: {'faulty' if i % 2 else 'fault-free'}",
              flush=True)
        turns.append(run_turn(i % 2 == 1, args, rng))
    write(report_of(turns, args), Path(args.out))


def reanalyse(saved: Path) -> None:
    """Recomputes a saved report from its turns' log folders (they must still exist)."""
    report = json.loads(saved.read_text())
    turns = []
    for turn in report["turns_detail"]:
        faults = [{k: v for k, v in f.items() if k in ("kind", "t", "world", "pid", "new_pid",
                                                      "woken")} for f in turn["faults"]]
        job = SimpleNamespace(root=Path(turn["log_dir"]), faults=faults)
        again = analyse(job, turn["t0"], turn["t0"] + turn["seconds"], True,
                        turn["processes_left_behind"], report["workers"])
        again["hangs"] = turn["hangs"]
        turns.append(again)
    args = SimpleNamespace(**{k: report[k] for k in ("workers", "turns", "seed")},
                           fault_every=report["fault_every_s"], duration=report["duration_s"])
    write(report_of(turns, args), saved)


def write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(report["table"])


if __name__ == "__main__":
    reanalyse(Path(sys.argv[1]))
