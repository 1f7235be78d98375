"""Soak: an elastic job under seeded random faults for N minutes, and what each fault cost.

Usage: ``.venv/bin/python benchmarks/soak.py --minutes 30 [--seed 1] [--out runs/soak.json]``
(not part of the test suite). It starts an embedded etcd on 127.0.0.1 and 4 workers of
``soak_worker.py`` (loopback gloo), then every 8-20 s (seeded) fires one fault:

- ``kill``: SIGKILL a worker (no launcher: the survivors see its connections close);
- ``stop``: SIGSTOP a worker for lease TTL + 2 s, then SIGCONT (it is fenced and rejoins);
- ``term``: SIGTERM a worker (it leaves at its next commit);
- ``join``: start one more worker;
- ``etcd``: restart etcd on its data directory (once, half way).

The world stays between 2 and 5 workers (kill/term/stop only with 3 or more, join only with 4 or
fewer). At the end it asks the job to stop at the next epoch boundary and reports: faults fired
by kind; recoveries (a ``resumed`` event after the fault) with p50/p95/max; seconds of training
lost per fault by kind (wall time up to the next fault beyond what the samples committed in it
take at the fault-free rate of the world size in force, that rate measured in the same run from
the stretches between recoveries and the next fault); samples lost or duplicated (from the job's
committed audit of every epoch); hangs (a worker fault with no recovery before the next fault,
or a job that does not end); workers that restarted in place (``--release-grace``); and worker
processes left behind.

Goodput: ``--fault-every S [--duration 1800] [--turns 1]`` runs instead one mixed fault every S
seconds (kill, stop, term, replace, join) in turns against fault-free runs of the same job and
reports useful steps/s divided by the fault-free steps/s, and the time lost per fault by kind:
see ``goodput.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from elastic.launch.embedded_etcd import EmbeddedEtcd
from elastic.launch.warm_start import ForkedProcess, WarmStart

HERE = Path(__file__).resolve().parent
LEASE_TTL_S = 3
# Steps here take ~20 ms: a training thread still inside one 5 s after its round was released
# is blocked (gloo's release race), and restarts in place well before the next fault.
RELEASE_GRACE_S = 5
STEADY_AFTER_S = 1.0  # a stretch counts towards the fault-free rate from 1 s after a recovery
MIN_WORLD, MAX_WORLD = 2, 5
TEMPLATE_READY = timedelta(seconds=180)  # under load torch's import took 30 s


class ForkedWorker:
    """A worker forked from the warm-start template, as ``elastic run`` forks a replacement:
    the part of ``subprocess.Popen`` the soak uses; its output goes to its log file."""

    def __init__(self, proc: ForkedProcess, log: IO[bytes]) -> None:
        self._proc = proc
        self.pid = proc.pid
        for stream in (proc.stdout, proc.stderr):
            threading.Thread(target=_copy, args=(stream, log), daemon=True).start()

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._proc.wait(timeout)

    def send_signal(self, sig: int) -> None:
        if self._proc.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _copy(stream: IO[bytes] | None, log: IO[bytes]) -> None:
    if stream is not None:
        for line in stream:
            log.write(line)
            log.flush()


class Soak:
    """The job, its workers and the faults fired at them. With ``warm``, a ``replace`` forks
    the new worker from a warm-start template, as ``elastic run`` does; others start cold."""

    def __init__(self, root: Path, etcd: EmbeddedEtcd, workers: int,
                 extra_env: dict[str, str] | None = None, warm: bool = False) -> None:
        self.root = root
        self.etcd = etcd
        self.env = dict(os.environ, ELASTIC_ETCD=etcd.url, ELASTIC_JOB_ID="soak",
                        ELASTIC_LEASE_TTL=str(LEASE_TTL_S), ELASTIC_LOG_DIR=str(root / "events"),
                        ELASTIC_RELEASE_GRACE=str(RELEASE_GRACE_S),
                        ELASTIC_MIN_WORKERS="1", MASTER_ADDR="127.0.0.1",
                        GLOO_SOCKET_IFNAME="lo", ELASTIC_ADVERTISE_ADDR="127.0.0.1",
                        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
        self.command = [sys.executable, str(HERE / "soak_worker.py"), "--out", str(root)]
        self.procs: list[Any] = []  # subprocess.Popen or ForkedWorker
        self.live: list[Any] = []
        self.faults: list[dict[str, Any]] = []
        self.pause = threading.Event()  # never set: paces the fault schedule
        self.template: WarmStart | None = None
        if warm:
            self.template = WarmStart(self.command, self.env, (), TEMPLATE_READY,
                                      timedelta(seconds=30))
            self.template.start()
            if not self.template.wait_ready():
                raise RuntimeError("the warm-start template did not start: see its line above")
        for _ in range(workers):
            self.start_worker()

    def start_worker(self, forked: bool = False) -> Any:
        log = open(self.root / f"worker-{len(self.procs)}.log", "ab")
        spawned = self.template.spawn(self.env, piped=True) \
            if forked and self.template is not None else None
        proc = ForkedWorker(spawned, log) if spawned is not None else subprocess.Popen(
            self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.procs.append(proc)
        self.live.append(proc)
        return proc

    def fire(self, kind: str, rng: random.Random,
             victims: list[subprocess.Popen[bytes]] | None = None) -> None:
        """Fires one fault; a worker fault hits one of ``victims`` (default: any live one)."""
        record: dict[str, Any] = {"kind": kind, "t": time.time(), "world": len(self.live)}
        if kind == "join":
            record["pid"] = self.start_worker().pid
        elif kind == "etcd":
            self.etcd.restart()
        else:
            victim = rng.choice(victims or self.live)
            record["pid"] = victim.pid
            if kind in ("kill", "replace"):
                victim.send_signal(signal.SIGKILL)
                self.live.remove(victim)
                if kind == "replace":  # as a launcher does: a new worker at once
                    record["new_pid"] = self.start_worker(forked=True).pid
            elif kind == "term":
                victim.send_signal(signal.SIGTERM)
                self.live.remove(victim)
            else:  # stop: frozen past its lease, then it wakes up fenced and rejoins
                victim.send_signal(signal.SIGSTOP)
                self.pause.wait(LEASE_TTL_S + 2)
                victim.send_signal(signal.SIGCONT)
                record["woken"] = time.time()
        self.faults.append(record)
        print(f"{time.strftime('%H:%M:%S')} {kind:5s} world {record['world']}", flush=True)

    def choose(self, rng: random.Random) -> str:
        kinds = []
        if len(self.live) > MIN_WORLD:
            kinds += ["kill", "stop", "term"]
        if len(self.live) < MAX_WORLD:
            kinds.append("join")
        return rng.choice(kinds)

    def finish(self, timeout_s: float) -> tuple[bool, int]:
        """Asks the job to stop; returns (ended in time, worker processes left behind)."""
        (self.root / "stop").touch()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        left = [p for p in self.procs if p.poll() is None]
        for proc in left:
            proc.kill()
            proc.wait(timeout=10)
        self.close()
        return not left, len(left)

    def close(self) -> None:
        """Ends the template, if any (its workers are ended by then)."""
        if self.template is not None:
            self.template.close()
            self.template = None


def read_jsonl(paths: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.endswith("}"):
                rows.append(json.loads(line))
    return sorted(rows, key=lambda r: r["t"])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def analyse(soak: Soak, ended_at: float) -> dict[str, Any]:
    """Recoveries, time lost per fault and the fault-free rates, from events and progress."""
    events = read_jsonl(sorted((soak.root / "events").glob("*.jsonl")))
    progress = read_jsonl([soak.root / "progress.jsonl"])
    resumed = [e for e in events if e["event"] == "resumed"]
    bounds = [f["t"] for f in soak.faults[1:]] + [ended_at]
    stretches = []
    for fault, end in zip(soak.faults, bounds):
        after = [e["t"] for e in resumed if fault["t"] < e["t"] < end]
        recovered = after[0] if after else None
        rows = [p for p in progress if fault["t"] < p["t"] <= end]
        worlds = [p["world"] for p in rows]
        world = max(set(worlds), key=worlds.count) if worlds else None
        steady = [p for p in rows if recovered is None or p["t"] > recovered + STEADY_AFTER_S]
        stretches.append({**fault, "end": end, "recovered": recovered, "world_after": world,
                          "samples": sum(p["samples"] for p in rows),
                          "steady_samples": sum(p["samples"] for p in steady[1:]),
                          "steady_s": steady[-1]["t"] - steady[0]["t"] if len(steady) > 1
                          else 0.0})
    rate: dict[int, float] = {}
    by_world: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s in stretches:
        if s["world_after"] is not None and s["steady_s"] > 2:
            by_world[s["world_after"]].append((s["steady_samples"], s["steady_s"]))
    for world, parts in by_world.items():
        rate[world] = sum(n for n, _ in parts) / sum(t for _, t in parts)
    for s in stretches:
        r = rate.get(s["world_after"]) if s["world_after"] is not None else None
        s["lost_s"] = (s["end"] - s["t"]) - s["samples"] / r if r else None
        s["recovery_s"] = s["recovered"] - s["t"] if s["recovered"] is not None else None
    restarts = [{"t": e["t"], "reason": e.get("reason", "")} for e in events
                if e["event"] == "restarting_in_place"]
    return {"stretches": stretches, "rate_samples_per_s": rate, "restarts_in_place": restarts}


def summary(stretches: list[dict[str, Any]]) -> dict[str, Any]:
    kinds: dict[str, Any] = {}
    for kind in sorted({s["kind"] for s in stretches}):
        mine = [s for s in stretches if s["kind"] == kind]
        rec = [s["recovery_s"] for s in mine if s["recovery_s"] is not None]
        lost = [s["lost_s"] for s in mine if s["lost_s"] is not None]
        kinds[kind] = {
            "fired": len(mine), "recovered": len(rec),
            "recovery_p50_s": statistics.median(rec) if rec else None,
            "recovery_p95_s": percentile(rec, 0.95) if rec else None,
            "recovery_max_s": max(rec) if rec else None,
            "lost_median_s": statistics.median(lost) if lost else None,
            "lost_max_s": max(lost) if lost else None,
        }
    return kinds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default=str(HERE.parent / "runs" / "soak.json"))
    p.add_argument("--fault-every", type=float, default=None,
                   help="goodput instead: one mixed fault every S seconds (goodput.py)")
    p.add_argument("--duration", type=float, default=1800,
                   help="goodput: seconds each turn is measured")
    p.add_argument("--turns", type=int, default=1,
                   help="goodput: faulty turns, each between two fault-free ones")
    args = p.parse_args()
    if args.fault_every is not None:
        if not 0 < args.fault_every <= args.duration:
            p.error(f"--fault-every {args.fault_every:g} must be > 0 and <= --duration "
                    f"{args.duration:g}: pick a shorter interval or a longer --duration")
        import goodput  # it imports this module's Soak
        goodput.main(args)
        return
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="elastic-soak-"))
    (root / "etcd").mkdir()
    etcd = EmbeddedEtcd(data_dir=str(root / "etcd")).start()
    soak = Soak(root, etcd, args.workers)
    try:
        started = time.monotonic()
        deadline = started + args.minutes * 60
        etcd_at = started + args.minutes * 30
        soak.pause.wait(20)  # the first round forms and trains before the first fault
        while time.monotonic() < deadline:
            etcd_due = not any(f["kind"] == "etcd" for f in soak.faults) \
                and time.monotonic() > etcd_at
            soak.fire("etcd" if etcd_due else soak.choose(rng), rng)
            soak.pause.wait(rng.uniform(8, 20))
        ended_in_time, left_behind = soak.finish(timeout_s=180)
        ended_at = time.time()
    finally:
        for proc in soak.procs:
            if proc.poll() is None:
                proc.kill()
        etcd.stop()
    analysis = analyse(soak, ended_at)
    result_path = root / "result.json"
    audit = json.loads(result_path.read_text())["audit"] if result_path.exists() else None
    worker_faults = [s for s in analysis["stretches"] if s["kind"] in ("kill", "stop", "term")]
    report = {
        "minutes": args.minutes, "seed": args.seed, "cores": os.cpu_count(),
        "faults": summary(analysis["stretches"]),
        "rate_samples_per_s": analysis["rate_samples_per_s"],
        "epochs": len(audit) if audit else 0,
        "samples_duplicated": sum(row[1] for row in audit) if audit else None,
        "samples_lost": sum(row[2] for row in audit) if audit else None,
        "hangs": sum(1 for s in worker_faults if s["recovery_s"] is None)
        + (0 if ended_in_time else 1),
        "restarts_in_place": analysis["restarts_in_place"],
        "processes_left_behind": left_behind, "log_dir": str(root),
        "stretches": analysis["stretches"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "stretches"}, indent=1))


if __name__ == "__main__":
    main()
