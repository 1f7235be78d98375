"""What a re-formation moves when a worker of a large model dies: the survivors' state sync.

Usage: ``.venv/bin/python benchmarks/bench_survivor_sync.py [--size 100m] [--optimizer adam]
[--reps 2] [--repo PATH] [--against PATH] [--out PATH]``.

Per rep: one embedded etcd and 3 workers (``elastic_worker.py``, copy-free commits every step,
batch 8, gloo on loopback, no launcher); at step 3 the worker of rank 2 is SIGKILLed. Reported
from the survivors' events: ``sync_s`` (finding the newest holder and moving its state) and
``recovery_s`` (the round's formation to the state in place), and from the progress lines the
time from the SIGKILL to the first step completed in world 2 (it includes the step that was in
flight and the whole next step: about 1.5 s each for the 100M model on 2 cores), split at the
survivors' last ``resumed``: the first step after it (which builds the round's DDP) against the
second step in world 2. ``--repo`` runs the workers of another checkout (an older commit) with
this same measurement; ``--against PATH`` runs both, taking turns (the order alternating per rep).
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
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402


def one_rep(repo: Path, size: str, optimizer: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix="survivor-sync-"))
    procs = harness.Procs(out)
    etcd = EmbeddedEtcd().start()
    try:
        env = harness.env_for(ELASTIC_ETCD=etcd.url, ELASTIC_JOB_ID="survivor-sync",
                         ELASTIC_LEASE_TTL="5", ELASTIC_LOG_DIR=str(out / "events"),
                         PYTHONPATH=f"{repo}:{repo / 'benchmarks'}")
        worker = str(repo / "benchmarks" / "elastic_worker.py")
        for _ in range(3):
            procs.start([sys.executable, worker, "--out", str(out), "--size", size,
                         "--optimizer", optimizer, "--commit-part", "copy-free",
                         "--commit-every", "1", "--batch", "8"], env)
        harness.wait_for(lambda: harness.steps_of(out, 3, 3), 600, "3 workers at step 3")
        victim = next(p["pid"] for p in reversed(harness.read_progress(out)) if p["rank"] == 2)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)

        def two_steps_at_2() -> list[float] | None:
            times = sorted(p["t"] for p in harness.read_progress(out)
                           if p["t"] > killed_at and p["world"] == 2 and p["rank"] == 0)
            return times if len(times) >= 2 else None

        steps = harness.wait_for(two_steps_at_2, 600, "two steps in world 2")
        synced, resumed = [], []
        for path in sorted((out / "events").glob("*.jsonl")):
            rows = [json.loads(line) for line in path.read_text().splitlines() if line]
            after = [r for r in rows if r["t"] > killed_at]
            sync = next((r for r in after if r["event"] == "state_synced"), None)
            back = next((r for r in after if r["event"] == "resumed"), None)
            if sync is not None and back is not None:
                synced.append({"sync_s": sync["sync_s"], "recovery_s": back["recovery_s"]})
                resumed.append(back["t"])
        return {"first_step_s": steps[0] - killed_at, "survivors": synced,
                "first_step_after_resumed_s": steps[0] - max(resumed),
                "second_step_s": steps[1] - steps[0]}
    finally:
        procs.kill_all()
        etcd.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", default="100m")
    parser.add_argument("--optimizer", default="adam", choices=("sgd", "adam"))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--repo", type=Path, default=HERE.parent)
    parser.add_argument("--against", type=Path, default=None,
                        help="another checkout whose workers take turns with --repo's")
    parser.add_argument("--out", type=Path, default=HERE / "runs" / "survivor-sync.json")
    args = parser.parse_args()
    sides = [args.repo.resolve()] + ([args.against.resolve()] if args.against else [])
    runs: dict[str, list[dict]] = {str(repo): [] for repo in sides}
    for rep in range(args.reps):
        for repo in sides if rep % 2 == 0 else sides[::-1]:
            runs[str(repo)].append(one_rep(repo, args.size, args.optimizer))
            print(f"rep {rep} {repo}: {json.dumps(runs[str(repo)][-1])}", flush=True)
    for repo, reps in runs.items():
        _report(repo, reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"size": args.size, "optimizer": args.optimizer,
                                    "repo": str(args.repo), "reps": runs[str(sides[0])],
                                    **({"against": str(sides[1]), "against_reps":
                                        runs[str(sides[1])]} if args.against else {})},
                                   indent=1))
    print(f"wrote {args.out}")


def _report(repo: str, reps: list[dict]) -> None:
    def med(key: str) -> str:
        return f"{statistics.median(r[key] for r in reps):.2f}"

    print(f"{repo}:")
    syncs = [s["sync_s"] for r in reps for s in r["survivors"]]
    recoveries = [s["recovery_s"] for r in reps for s in r["survivors"]]
    firsts = ", ".join(f"{r['first_step_s']:.2f}" for r in reps)
    print(f"survivors' sync_s median {statistics.median(syncs):.3f} (all: "
          f"{', '.join(f'{x:.3f}' for x in syncs)}); recovery_s median "
          f"{statistics.median(recoveries):.3f}; SIGKILL -> first step in world 2: {firsts} s")
    print(f"  median: the first step after resumed {med('first_step_after_resumed_s')} s, the "
          f"second step {med('second_step_s')} s, SIGKILL -> first step {med('first_step_s')} s")


if __name__ == "__main__":
    main()
