"""Steady state, side by side in time: two running jobs take turns on the CPU in short slices.

Usage: ``.venv/bin/python benchmarks/bench_interleaved.py [--pairs 80] [--slice-s 1] [--runs 1]
[--out PATH]``. Prints the result; writes it as JSON only to an ``--out`` that is named.

The throughput pair of ``bench_recovery.py`` runs one job after the other, and this machine's
speed drifts by up to 20% over minutes, which two runs of the same job showed (its ``--control``).
Here both jobs run at once and take turns: every process of job A (workers, launcher or etcd) is
resumed for one slice while every process of job B is stopped (SIGSTOP), then the other way
round, the order alternating per pair of slices. Each job's steps/s is counted over the step
intervals of its rank 0 that lie wholly inside its own slices, so both jobs meet the same machine
within a second of each other and the drift cancels out of their ratio. Each job's CPU time per
step (all its processes, read while they are stopped) says whether a slower job worked more or
waited more.

Jobs: ``torchrun`` (plain DDP under torchrun, ``torchrun_worker.py``) and ``ours``
(``elastic_worker.py``, commit() every 10 steps, on an embedded etcd that is stopped and resumed
with its workers). ``--control`` pairs torchrun with a second torchrun job: what the method
reports for two identical jobs; ``--baseline ours-no-commits`` pairs ours with the same job of
ours that never commits: what the commits alone cost. ``--candidate trainstate`` (or
``trainstate-etcd``) puts our state layer's loop under torchrun in ours' place
(``torchrun_trainstate_worker.py``: TrainState, ElasticSampler and the same commits, without
ElasticState; with an etcd membership in each worker), to tell the state layer's share of a
difference from the cluster layer's. The lease TTL stays at its default (3 s);
a slice of 1 s cannot let a lease expire, and the run checks that ours never re-formed.

Re-executes itself in a private network namespace, like ``bench_recovery.py``.
"""

from __future__ import annotations

import argparse
import collections
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

from harness import Procs, env_for, read_progress, wait_for  # noqa: E402
from elastic.cluster.links.ports import free_port  # noqa: E402
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402


JOBS = {  # job name -> (worker script, whether it needs an embedded etcd)
    "torchrun": ("torchrun_worker.py", False), "torchrun-again": ("torchrun_worker.py", False),
    "ours": ("elastic_worker.py", True), "ours-no-commits": ("elastic_worker.py", True),
    "trainstate": ("torchrun_trainstate_worker.py", False),
    "trainstate-etcd": ("torchrun_trainstate_worker.py", True),
}


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (torchrun's workers live in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        if current not in found:
            found.add(current)
            todo += children.get(current, [])
    return found


def _read(path: Path) -> str:
    return path.read_text().strip()


def _cpu_ticks(stat: Path) -> int:
    """User + system clock ticks from a ``/proc/.../stat`` file (a process's or a thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class Job:
    """One 2-worker training job whose processes are stopped and resumed together."""

    def __init__(self, name: str, out: Path) -> None:
        self.name, self.out = name, out
        self.procs = Procs(out)
        self.etcd: EmbeddedEtcd | None = None
        self.windows: list[tuple[float, float]] = []
        self.cpu_s = 0.0  # CPU time of all its processes inside its slices
        self.thread_s: collections.Counter[str] = collections.Counter()  # the same, per thread
        self._pids: set[int] = set()
        self._workers: set[int] = set()

    def launch(self, batch: int, commit_every: int, commit_part: str) -> None:
        """Starts the job named (see ``JOBS``), with an embedded etcd where it needs one."""
        self.out.mkdir(parents=True)
        script, needs_etcd = JOBS[self.name]
        args = ["--out", str(self.out), "--steps", str(10**9), "--batch", str(batch)]
        if needs_etcd:
            self.etcd = EmbeddedEtcd().start()
        if self.name.startswith("ours"):
            every = 10**9 if self.name == "ours-no-commits" else commit_every
            for _ in range(2):
                self.procs.start([sys.executable, script, *args, "--commit-every", str(every),
                                  "--commit-part", commit_part],
                                 env_for(ELASTIC_ETCD=self.etcd.url, ELASTIC_JOB_ID=self.out.name))
            return
        if self.name.startswith("trainstate"):
            args += ["--commit-every", str(commit_every)]
            if self.etcd is not None:
                args += ["--etcd", self.etcd.url]
        self.procs.start([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                          "--nproc-per-node=2", "--rdzv-backend=c10d",
                          f"--rdzv-endpoint=127.0.0.1:{free_port()}", script, *args], env_for())

    def settle(self) -> None:
        """Records the job's processes once it trains (its process tree no longer changes)."""
        roots = [p.pid for p in self.procs.procs]
        if self.etcd is not None and self.etcd.process is not None:
            roots.append(self.etcd.process.pid)
        self._pids = set().union(*(descendants(pid) for pid in roots))
        self._workers = {p["pid"] for p in read_progress(self.out)}

    def signal(self, sig: signal.Signals) -> None:
        for pid in self._pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def run_for(self, slice_s: float) -> None:
        """Resumes the job for one slice (the driver's clock decides its length), then stops it."""
        before, threads_before = self.cpu_time(), self.thread_times()
        self.signal(signal.SIGCONT)
        start = time.time()
        time.sleep(slice_s)
        self.signal(signal.SIGSTOP)
        self.windows.append((start, time.time()))
        self.cpu_s += self.cpu_time() - before
        self.thread_s.update(self.thread_times())
        self.thread_s.subtract(threads_before)

    def cpu_time(self) -> float:
        """User + system seconds of every process of the job so far."""
        total = 0
        for pid in self._pids:
            try:
                total += _cpu_ticks(Path(f"/proc/{pid}/stat"))
            except OSError:
                continue
        return total / os.sysconf("SC_CLK_TCK")

    def thread_times(self) -> collections.Counter[str]:
        """User + system seconds per kind of thread: "worker/main", "worker/gloo_tcp_loop",
        "etcd/etcd" (a process that is not a worker is named by its command)."""
        ticks: collections.Counter[str] = collections.Counter()
        for pid in self._pids:
            try:
                role = "worker" if pid in self._workers else _read(Path(f"/proc/{pid}/comm"))
                for task in Path(f"/proc/{pid}/task").iterdir():
                    name = "main" if int(task.name) == pid else _read(task / "comm")
                    ticks[f"{role}/{name}"] += _cpu_ticks(task / "stat")
            except OSError:
                continue
        tick_s = 1 / os.sysconf("SC_CLK_TCK")
        return collections.Counter({k: v * tick_s for k, v in ticks.items()})

    def steps_in_slices(self) -> int:
        """Rank 0's steps completed inside the job's slices."""
        times = [p["t"] for p in read_progress(self.out) if p["rank"] == 0]
        return sum(1 for t in times for start, end in self.windows if start <= t <= end)

    def close(self) -> None:
        self.settle()
        self.signal(signal.SIGCONT)
        self.procs.kill_all()
        if self.etcd is not None:
            self.etcd.stop()

    def intervals(self) -> list[list[tuple[int, float]]]:
        """Per slice: (step, seconds) of rank 0's step intervals wholly inside that slice."""
        rank0 = [p for p in read_progress(self.out) if p["rank"] == 0]
        slices: list[list[tuple[int, float]]] = [[] for _ in self.windows]
        generations = set()
        for before, after in zip(rank0, rank0[1:]):
            if after["step"] != before["step"] + 1:
                continue
            for i, (start, end) in enumerate(self.windows):
                if start <= before["t"] and after["t"] <= end:
                    slices[i].append((after["step"], after["t"] - before["t"]))
                    generations.add(after.get("generation"))
                    break
        if len(generations) > 1:
            raise RuntimeError(f"{self.name} re-formed during the slices (generations "
                               f"{sorted(generations)}): a lease expired while it was stopped.")
        return slices


def rate(intervals: list[tuple[int, float]]) -> float:
    return len(intervals) / sum(s for _, s in intervals)


def commit_cost_ms(slices: list[list[tuple[int, float]]], every: int,
                   average=statistics.median) -> float | None:
    """The ``average`` interval that holds a commit minus that of the others (ms); None when no
    measured interval holds a commit, or every one does (a commit every step). The mean is what
    throughput pays; the median hides the long tail of waiting for the other rank."""
    flat = [x for s in slices for x in s]
    with_commit = [s for step, s in flat if (step - 1) % every == 0]
    without = [s for step, s in flat if (step - 1) % every != 0]
    if not with_commit or not without:
        return None
    return (average(with_commit) - average(without)) * 1000


def measure(args: argparse.Namespace, root: Path) -> dict:
    names = [args.baseline, "torchrun-again" if args.control else args.candidate]
    jobs: list[Job] = []
    try:
        for name in names:
            jobs.append(Job(name, root / name))
            jobs[-1].launch(args.batch, args.commit_every, args.commit_part)
        for job in jobs:
            wait_for(lambda job=job: any(p["step"] >= 50 for p in read_progress(job.out)), 180,
                     f"{job.name} at step 50")
        for job in jobs:
            job.settle()
            job.signal(signal.SIGSTOP)
        for pair in range(args.pairs):
            for i in ((0, 1) if pair % 2 == 0 else (1, 0)):
                jobs[i].run_for(args.slice_s)
    finally:
        for job in jobs:
            job.close()
    warm = args.warm_pairs
    slices = [job.intervals()[warm:] for job in jobs]
    # A pair counts only when both of its slices hold a whole step interval.
    ratios = [rate(b) / rate(a) for a, b in zip(*slices) if a and b]
    if len(ratios) < 2:
        raise RuntimeError(f"only {len(ratios)} pairs of slices held whole steps: lengthen "
                           f"--slice-s ({args.slice_s}) or shorten the steps (--batch).")
    quartiles = statistics.quantiles(ratios, n=4)
    steps_per_s = [rate([x for s in per_job for x in s]) for per_job in slices]
    result = {
        "jobs": names, "pairs": len(ratios), "slice_s": args.slice_s, "batch": args.batch,
        "commit_every": args.commit_every, "commit_part": args.commit_part,
        "steps_per_s": steps_per_s, "ratio": steps_per_s[1] / steps_per_s[0],
        "ratio_per_pair_median": statistics.median(ratios),
        "ratio_per_pair_quartiles": [quartiles[0], quartiles[2]],
        "ratio_per_pair": ratios,
    }
    # CPU per step of the whole job (all processes, all cores): when a job is slower, did it
    # work more per step, or wait more?
    steps = [job.steps_in_slices() for job in jobs]
    result["cpu_ms_per_step"] = [job.cpu_s / n * 1000 for job, n in zip(jobs, steps)]
    result["cpu_ms_per_step_by_thread"] = {
        job.name: {k: round(v / n * 1000, 3)
                   for k, v in sorted(job.thread_s.items(), key=lambda kv: -kv[1]) if v > 0}
        for job, n in zip(jobs, steps)}
    if not args.control:
        result["ours_commit_cost_ms"] = commit_cost_ms(slices[1], args.commit_every)
        result["ours_commit_cost_mean_ms"] = commit_cost_ms(slices[1], args.commit_every,
                                                            statistics.fmean)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=80, help="pairs of slices (default 80)")
    parser.add_argument("--warm-pairs", type=int, default=4,
                        help="first pairs left out of the figures (default 4)")
    parser.add_argument("--slice-s", type=float, default=1.0, help="slice length (default 1 s)")
    parser.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    parser.add_argument("--commit-every", type=int, default=10,
                        help="ours commits every N steps (default 10)")
    parser.add_argument("--commit-part", choices=("both", "snapshot", "agreement"),
                        default="both", help="what ours' commit does (elastic_worker.py)")
    parser.add_argument("--control", action="store_true",
                        help="torchrun against a second torchrun job instead of ours")
    parser.add_argument("--candidate", choices=("ours", "trainstate", "trainstate-etcd"),
                        default="ours", help="the job measured against the baseline: ours "
                        "(default), or our state layer's loop (TrainState, ElasticSampler, the "
                        "same commits) under torchrun, without or with an etcd membership in "
                        "each worker: where a difference from plain DDP comes from")
    parser.add_argument("--baseline", choices=("torchrun", "ours-no-commits"), default="torchrun",
                        help="what ours is compared with: plain DDP under torchrun (default), or "
                             "the same job of ours without commits (what the commits cost)")
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat the measurement with fresh jobs; report the median ratio")
    parser.add_argument("--out", "--json", type=Path, default=None,
                        help="also write the result as JSON to this file (default: print only)")
    args = parser.parse_args()
    if args.slice_s > 2.0:
        parser.error(f"--slice-s ({args.slice_s}) must be at most 2 s: ours' workers and etcd "
                     f"are stopped for a slice at a time and the lease TTL is 3 s.")
    if args.control and (args.baseline != "torchrun" or args.candidate != "ours"):
        parser.error("--control compares two torchrun jobs; leave out --baseline and "
                     "--candidate.")
    if args.candidate != "ours" and args.commit_part != "both":
        parser.error("--commit-part applies to ours only; leave it out with --candidate.")
    if args.runs < 1:
        parser.error(f"--runs ({args.runs}) must be at least 1.")
    if args.pairs <= args.warm_pairs + 1:
        parser.error(f"--pairs ({args.pairs}) must exceed --warm-pairs ({args.warm_pairs}) + 1.")
    if os.environ.get("BENCH_NETNS") != "1":
        os.execvpe("unshare", ["unshare", "-n", "sh", "-c",
                               f"ip link set lo up && exec {sys.executable} {Path(__file__)} "
                               + " ".join(sys.argv[1:])], dict(os.environ, BENCH_NETNS="1"))
    runs = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="elastic-interleaved-") as tmp:
            runs.append(measure(args, Path(tmp)))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "ratio_per_pair"}, indent=1))
        print(f"run {run + 1} of {args.runs}: ratio {runs[-1]['ratio']:.3f}", flush=True)
    result = runs[0] if args.runs == 1 else summarize(runs)
    if args.runs > 1:
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


def summarize(runs: list[dict]) -> dict:
    """Several runs, each with jobs of its own: the median of their ratios and its spread.

    A job's speed depends on the process it got as well as on the code (the same GEMMs ran up to
    8% apart in two jobs of one run, both ways round), and a run keeps its processes throughout;
    so the spread that matters is between runs, and many short runs beat a few long ones.
    """
    ratios = [r["ratio"] for r in runs]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"jobs": runs[0]["jobs"], "runs_count": len(runs), "ratios": ratios,
            "ratio_median": statistics.median(ratios),
            "ratio_quartiles": [quartiles[0], quartiles[2]],
            "runs_at_or_above_0.98": sum(r >= 0.98 for r in ratios), "runs": runs}


if __name__ == "__main__":
    main()
