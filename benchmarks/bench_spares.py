"""A lost worker's replacement: a warm spare (``elastic run --spares 1``), a worker forked from
the warm-start template (the default), and a cold restart (``--no-warm-start``).

Usage: ``.venv/bin/python benchmarks/bench_spares.py [--reps 5] [--out PATH]``. Each rep runs
the three modes, in alternating order, as ``elastic run -n 2`` on one embedded etcd: SIGKILL one of
the two training workers at step 30, then measure, from the kill (wall clock, from the workers'
per-step progress lines):

- replacement: the first step the replacing process completes (warm spare: already imported
  and registered; forked: forked from the template, imported already; cold: the restarted
  process, which imports torch first);
- survivor: the first step the surviving worker completes in a new generation (with the spare;
  or alone, while a cold restart imports torch).

Prints a table and writes the raw figures as JSON to ``--out`` (default ``runs/spares.json``,
which git ignores).
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
sys.path.insert(0, str(HERE))

from harness import REPO, Procs, env_for, read_progress, wait_for  # noqa: E402

from elastic.cluster.etcd.client import EtcdClient  # noqa: E402
from elastic.cluster.rounds.keys import JobKeys  # noqa: E402
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402

ELASTIC = str(Path(sys.executable).with_name("elastic"))


def one_replacement(etcd: EmbeddedEtcd, out: Path, job: str, spares: int,
                    start: str = "--warm-start") -> dict[str, float]:
    """Kills one of two workers at step 30 and times its replacement's and the survivor's first
    steps (seconds after the kill)."""
    procs = Procs(out)
    client = EtcdClient(etcd.url)
    try:
        procs.start([ELASTIC, "run", "--etcd", etcd.url, "--job-id", job, "-n", "2",
                     "--spares", str(spares), "--max-restarts", "1", "--lease-ttl", "2",
                     *([start] if start == "--no-warm-start" else []),
                     str(HERE / "elastic_worker.py"), "--out", str(out)], env_for())
        at_30 = lambda: {p["pid"] for p in read_progress(out)  # noqa: E731
                         if p["step"] >= 30 and p["world"] == 2}
        trainers = wait_for(lambda: (lambda pids: pids if len(pids) == 2 else None)(at_30()),
                            120, "2 workers at step 30")
        members = JobKeys(job).members
        wait_for(lambda: len(client.get_prefix(members)[0]) == 2 + spares, 60,
                 "every worker and spare registered")
        victim = min(trainers)
        survivor_pid = next(iter(trainers - {victim}))
        generation = max(p["generation"] for p in read_progress(out) if p["pid"] == survivor_pid)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        replacement = wait_for(lambda: next((p for p in read_progress(out)
                                             if p["pid"] not in trainers), None), 120,
                               "the replacement's first step")
        survivor = wait_for(lambda: next((p for p in read_progress(out)
                                          if p["pid"] == survivor_pid
                                          and p["generation"] > generation), None), 60,
                            "the survivor's first step in a new world")
        return {"replacement_s": replacement["t"] - killed_at,
                "survivor_s": survivor["t"] - killed_at}
    finally:
        client.close()
        procs.kill_all()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(REPO / "runs" / "spares.json"))
    args = p.parse_args()
    order = [("warm spare", 1, "--warm-start"), ("forked", 0, "--warm-start"),
             ("cold restart", 0, "--no-warm-start")]
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode, _, _ in order}
    with EmbeddedEtcd() as etcd:
        for rep in range(args.reps):
            for n, (mode, spares, start) in enumerate(order if rep % 2 == 0 else order[::-1]):
                with tempfile.TemporaryDirectory(prefix="bench-spares-") as tmp:
                    figures = one_replacement(etcd, Path(tmp), f"spares-{rep}-{n}", spares,
                                              start)
                results[mode].append(figures)
                print(f"rep {rep} {mode}: replacement {figures['replacement_s']:.2f} s, "
                      f"survivor {figures['survivor_s']:.2f} s", flush=True)
    print(f"\n{'mode':<14}{'replacement median (s)':>24}{'survivor median (s)':>22}")
    for mode, runs in results.items():
        print(f"{mode:<14}{statistics.median(r['replacement_s'] for r in runs):>24.2f}"
              f"{statistics.median(r['survivor_s'] for r in runs):>22.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cores": os.cpu_count(), "results": results},
                                         indent=1))


if __name__ == "__main__":
    main()
