"""A commit every step, by model size: plain DDP against ours, copy-free and snapshot commits.

Usage: ``.venv/bin/python benchmarks/bench_commit_sweep.py [--sizes 1m,10m,100m] [--runs 4,3,2]
[--jobs torchrun,copy-free,snapshot,no-commits] [--out PATH]``. Prints the result; writes it as
JSON only to an ``--out`` that is named.

For each model size (the 3-layer MLP of ``workload.py`` at ~1M, ~10M and ~100M parameters, Adam,
2 gloo workers a job), the jobs named run at once and take turns on the CPU, as in
``bench_interleaved.py`` (whose ``Job`` this reuses): every process of one job (workers, and
etcd for ours) is resumed for one slice while every process of the others is stopped, the order
rotating every round. The jobs: ``torchrun`` (plain DDP under torchrun, ``torchrun_worker.py``:
the anchor), ``copy-free`` (``elastic_worker.py --commit-part copy-free``: every step inside
``commit_step()``), ``snapshot`` (``elastic_worker.py``, ``commit()`` after every step: a
copy of the parameters and both Adam moments) and ``no-commits`` (the same worker of ours that
never commits: what ours costs without commits) and, when named (an optional extra), ``torchft``
(``torchft_worker.py``: 2 replica groups of one process and a lighthouse at torchft's defaults,
its ``DistributedDataParallel`` and ``Optimizer``: ``should_commit`` every step; name it with
one other job only, ``--jobs torchrun,torchft``, so that it is never stopped longer than its 5 s
heartbeat timeout). The first job named is the anchor; at ~100M
parameters, run the jobs two at a time (``--jobs torchrun,copy-free``, then
``--jobs torchrun,snapshot``): four jobs' state is ~20 GB. Each job's steps/s counts only rank
0's step intervals that lie wholly inside its own slices; each ratio is a job's steps/s over
the anchor's in the same run. Slices and batches grow with the model so that a slice holds whole
steps; ours' lease TTL is raised (``ELASTIC_LEASE_TTL``) above the time a job is stopped, and
the run checks that ours never re-formed.

Re-executes itself in a private network namespace, like ``bench_interleaved.py``.
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
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_interleaved import Job, rate  # noqa: E402
from harness import env_for, read_progress, wait_for  # noqa: E402
from torchft_anchor import TorchftJob  # noqa: E402
from torchft_anchor import require as require_torchft  # noqa: E402
from elastic.cluster.links.ports import free_port  # noqa: E402
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402

JOBS = ("torchrun", "copy-free", "snapshot", "no-commits")  # the first named is the anchor
OPTIONAL_JOBS = ("torchft",)  # pip install -e '.[bench-torchft]'

# The same glibc allocator settings for every job. Left dynamic, the mmap threshold depends on
# each process's allocation history: in one job of this sweep one worker page-faulted ~10k
# times a second on the step's multi-MB temporaries and its peer not at all, which moved a
# job's steps/s by up to 2x whatever its code. Fixed, every tensor under 32 MB is reused from
# the heap in every process, and every larger one is mapped afresh in every process.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
             "MALLOC_TRIM_THRESHOLD_": str(64 * 1024**3)}


@dataclass(frozen=True)
class Size:
    """How one model size is run: samples per worker and step, slice length, rounds."""

    batch: int
    slice_s: float
    rounds: int
    warm_steps: int


SIZES = {"1m": Size(batch=32, slice_s=1.0, rounds=20, warm_steps=30),
         "10m": Size(batch=32, slice_s=3.0, rounds=8, warm_steps=6),
         "100m": Size(batch=8, slice_s=9.0, rounds=6, warm_steps=3)}


class SweepJob(Job):
    """A job of the sweep: plain DDP, or ours with a copy-free or a snapshot commit every step."""

    def __init__(self, name: str, out: Path, size: str, lease_ttl_s: int) -> None:
        super().__init__(name, out)
        self.size, self.lease_ttl_s = size, lease_ttl_s

    def launch(self, batch: int) -> None:  # type: ignore[override]
        self.out.mkdir(parents=True)
        args = ["--out", str(self.out), "--steps", str(10**9), "--batch", str(batch),
                "--size", self.size, "--optimizer", "adam"]
        if self.name == "torchrun":
            self.procs.start([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                              "--nproc-per-node=2", "--rdzv-backend=c10d",
                              f"--rdzv-endpoint=127.0.0.1:{free_port()}", "torchrun_worker.py",
                              *args], env_for(**ALLOCATOR))
            return
        if self.name == "torchft":
            TorchftJob(self.out, "default", replicas=2, worker_args=tuple(args[2:]),
                       procs=self.procs, env=ALLOCATOR)
            return
        self.etcd = EmbeddedEtcd().start()
        part = "copy-free" if self.name == "copy-free" else "both"
        every = 10**9 if self.name == "no-commits" else 1
        # min 2: a job that never commits never admits a joiner, so a first round of one
        # worker (the other still importing torch) would train alone for good.
        env = env_for(ELASTIC_ETCD=self.etcd.url, ELASTIC_JOB_ID=self.out.name,
                      ELASTIC_LEASE_TTL=str(self.lease_ttl_s), ELASTIC_MIN_WORKERS="2",
                      **ALLOCATOR)
        for _ in range(2):
            self.procs.start([sys.executable, "elastic_worker.py", *args, "--commit-every",
                              str(every), "--commit-part", part], env)


def measure(size: str, names: list[str], root: Path) -> dict:
    """One run at one size: fresh jobs taking turns; their steps/s and ratios to the first."""
    plan = SIZES[size]
    stopped_s = plan.slice_s * (len(names) - 1)
    lease_ttl_s = max(3, int(4 * stopped_s))
    jobs: list[SweepJob] = []
    try:
        for name in names:
            jobs.append(SweepJob(name, root / f"{size}-{name}", size, lease_ttl_s))
            jobs[-1].launch(plan.batch)
        for job in jobs:
            wait_for(lambda job=job: any(p["step"] >= plan.warm_steps
                                         for p in read_progress(job.out)), 600,
                     f"{job.name} ({size}) at step {plan.warm_steps}")
        for job in jobs:
            job.settle()
            job.signal(signal.SIGSTOP)
        for turn in range(plan.rounds):
            for i in range(len(jobs)):
                jobs[(turn + i) % len(jobs)].run_for(plan.slice_s)
    finally:
        for job in jobs:
            job.close()
    for job in jobs:
        worlds = {p["world"] for p in read_progress(job.out) if p["step"] >= plan.warm_steps}
        if worlds != {2}:
            raise RuntimeError(f"{job.name} trained in worlds {sorted(worlds)}, not 2.")
    slices = [job.intervals()[1:] for job in jobs]  # the first round warms the caches
    steps_per_s = {job.name: rate([x for s in per for x in s]) for job, per in zip(jobs, slices)}
    anchor = steps_per_s[names[0]]
    per_round = {name: [rate(b) / rate(a) for a, b in zip(slices[0], slices[i]) if a and b]
                 for i, name in enumerate(names) if i}
    return {"size": size, "parameters": parameters(size), "batch": plan.batch,
            "slice_s": plan.slice_s, "rounds": plan.rounds, "lease_ttl_s": lease_ttl_s,
            "intervals": {job.name: sum(len(s) for s in per) for job, per in zip(jobs, slices)},
            "steps_per_s": steps_per_s,
            "anchor": names[0], "ratio": {name: steps_per_s[name] / anchor for name in names[1:]},
            "ratio_per_round_median": {name: statistics.median(r) if r else None
                                       for name, r in per_round.items()},
            "cpu_ms_per_step": {job.name: job.cpu_s / max(job.steps_in_slices(), 1) * 1000
                                for job in jobs},
            "cpu_ms_per_step_by_thread": {
                job.name: {k: round(v / max(job.steps_in_slices(), 1) * 1000, 3)
                           for k, v in sorted(job.thread_s.items(), key=lambda kv: -kv[1])
                           if v > 0} for job in jobs}}


def parameters(size: str) -> int:
    """The model's parameter count at ``size`` (``workload.SIZES``: a 3-layer MLP)."""
    import workload
    hidden = workload.SIZES[size]
    return (workload.FEATURES + 1) * hidden + (hidden + 1) * hidden \
        + (hidden + 1) * workload.CLASSES


def summarize(size: str, names: list[str], runs: list[dict]) -> dict:
    """Several runs at one size: the median of each job's ratio to the anchor of its run, and
    of copy-free's and snapshot's ratio to no-commits where that job ran too."""
    result = {"size": size, "anchor": names[0], "runs_count": len(runs),
              "ratios": {name: [r["ratio"][name] for r in runs] for name in names[1:]},
              "ratio_median": {name: statistics.median(r["ratio"][name] for r in runs)
                               for name in names[1:]}}
    if "no-commits" in names[1:]:
        to_none = {name: [r["steps_per_s"][name] / r["steps_per_s"]["no-commits"] for r in runs]
                   for name in names if name in ("copy-free", "snapshot")}
        result["to_no_commits_median"] = {k: statistics.median(v) for k, v in to_none.items()}
    return result | {"runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1m,10m,100m",
                        help=f"comma-separated, of {', '.join(SIZES)} (default all)")
    parser.add_argument("--runs", default="1",
                        help="runs (fresh jobs) per size: one number, or one per size")
    parser.add_argument("--jobs", default=",".join(JOBS),
                        help=f"comma-separated, the anchor first (default {','.join(JOBS)})")
    parser.add_argument("--out", "--json", type=Path, default=None,
                        help="also write the result as JSON to this file (default: print only)")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    names = args.jobs.split(",")
    if len(names) < 2 or len(set(names)) != len(names) or set(names) - set(JOBS + OPTIONAL_JOBS):
        parser.error(f"--jobs ({args.jobs}) names two or more different jobs of "
                     f"{JOBS + OPTIONAL_JOBS}.")
    if "torchft" in names:
        require_torchft()
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        parser.error(f"--sizes names {unknown}; choose among {sorted(SIZES)}.")
    runs_per_size = [int(n) for n in args.runs.split(",")]
    if len(runs_per_size) == 1:
        runs_per_size *= len(sizes)
    if len(runs_per_size) != len(sizes) or min(runs_per_size) < 1:
        parser.error(f"--runs ({args.runs}) is one number >= 1, or one per size ({len(sizes)}).")
    if os.environ.get("BENCH_NETNS") != "1":
        os.execvpe("unshare", ["unshare", "-n", "sh", "-c",
                               f"ip link set lo up && exec {sys.executable} {Path(__file__)} "
                               + " ".join(sys.argv[1:])], dict(os.environ, BENCH_NETNS="1"))
    result = {"machine_cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "jobs": names,
              "optimizer": "adam", "workers_per_job": 2, "sizes": {}}
    for size, count in zip(sizes, runs_per_size):
        runs = []
        for run in range(count):
            with tempfile.TemporaryDirectory(prefix="elastic-sweep-") as tmp:
                runs.append(measure(size, names, Path(tmp)))
            print(f"{size} run {run + 1} of {count}: " + json.dumps(
                {k: runs[-1][k] for k in ("ratio", "steps_per_s", "intervals",
                                          "cpu_ms_per_step")}), flush=True)
        result["sizes"][size] = summarize(size, names, runs)
        print(json.dumps({k: v for k, v in result["sizes"][size].items() if k != "runs"}),
              flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
