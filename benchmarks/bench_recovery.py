"""Recovery, scale-up and steady-state throughput: elastic-trainer against torchrun, in one run.

Usage: ``.venv/bin/python benchmarks/bench_recovery.py [--reps 5] [--out PATH]``. Prints a table
and writes the raw figures as JSON to ``--out`` (default ``runs/recovery.json``, which git
ignores; a file under ``benchmarks/results/`` changes only when named). It re-executes itself in
a private network namespace (``unshare -n``, loopback only), because torchrun's rendezvous store
listens on every interface; inside the namespace the only interface is a private loopback.

Measured (wall clock, from the workers' per-step progress lines):
- recovery: SIGKILL one of 4 gloo workers at step 30 -> the first step completed afterwards in
  the new world (ours: world 3 in the same processes; torchrun --max-restarts: a restarted world).
- node loss (ours): SIGSTOP one worker (no TCP reset: its heartbeats stop) -> first step in world 3,
  at the default timeouts (lease TTL 3 s, frozen 0.5 s).
- scale-up (ours): a 4th worker's process start -> its first step; the longest pause of the others.
- steady state: steps/s of 2 workers, ours with commit() every 10 and every step, against the same
  loop as plain DDP under torchrun.

``--recovery-only`` runs the failure cases only, per rep: SIGKILL with no launcher, the same
under torchrun, SIGKILL under ``elastic run`` (whose launcher revokes the dead worker's lease),
the same with 2 DataLoader worker processes per worker, and SIGSTOP (at the defaults: its
heartbeats tell, not its lease). With ``--torchft`` (an optional extra) torchft joins them as
an anchor, at its defaults and at its lowest documented timeouts (``torchft_anchor.py``).

``--loader-kills N`` runs only the DataLoader case, N times, for its tail: the median, the
90th percentile, the slowest, and the kills slower than 1 s, whose folders it keeps.

``--throughput-only`` runs the steady-state pair only (order alternating per rep; ``--batch``,
``--steps``, ``--pin`` to bind worker i to core i) and adds what one commit costs rank 0: the
median step interval that holds a commit minus the median of the others. ``--control`` swaps
ours for torchrun with an idle etcd beside it: two runs of the same job, to show the noise.
``--commit-part snapshot|agreement`` makes ours' commit do only one of its two halves.
``bench_interleaved.py`` measures the same pair with both jobs alive, taking turns on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from elastic.cluster.links.ports import free_port  # noqa: E402
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402

from harness import Procs, env_for, read_progress, steps_of, wait_for  # noqa: E402

SLOW_S = 1.0  # --loader-kills: a kill slower than this is a stall, and keeps its folder


def ours_fault(out: Path, sig: signal.Signals, lease_ttl: str | None = "2") -> float:
    """Signal ``sig`` to rank 1 of 4 at step 30 -> the first step in world 3 (``lease_ttl``
    None: the default)."""
    etcd = EmbeddedEtcd().start()
    procs = Procs(out)
    try:
        env = env_for(ELASTIC_ETCD=etcd.url, ELASTIC_JOB_ID="bench",
                      **({} if lease_ttl is None else {"ELASTIC_LEASE_TTL": lease_ttl}))
        for _ in range(4):
            procs.start([sys.executable, "elastic_worker.py", "--out", str(out)], env)
        wait_for(lambda: steps_of(out, 30, 4), 120, "4 elastic workers at step 30")
        victim = next(p["pid"] for p in reversed(read_progress(out)) if p["rank"] == 1)
        killed_at = time.time()
        os.kill(victim, sig)
        first = wait_for(lambda: next((p for p in read_progress(out) if p["t"] > killed_at
                                       and p["world"] == 3), None), 60, "a step in world 3")
        return first["t"] - killed_at
    finally:
        procs.kill_all()
        etcd.stop()


def ours_launcher_kill(out: Path, loader_workers: int = 0, persistent: bool = False) -> float:
    """SIGKILL of rank 1 of 4 workers under ``elastic run`` (embedded etcd): its launcher sees
    the worker die and revokes its lease -> the first step in world 3. ``loader_workers``: each
    worker's DataLoader processes, made anew by every call of the training function, or with
    ``persistent`` made once before ``ElasticState.run`` with ``persistent_workers=True``."""
    procs = Procs(out)
    try:
        launcher = Path(sys.executable).with_name("elastic")
        procs.start([str(launcher), "run", "-n", "4", "--log-dir", str(out / "events"),
                     "elastic_worker.py", "--out", str(out),
                     "--loader-workers", str(loader_workers),
                     *(["--persistent-loader"] if persistent else [])], env_for())
        wait_for(lambda: steps_of(out, 30, 4), 120, "4 workers under elastic run at step 30")
        before = read_progress(out)
        rounds = {p["pid"]: p["generation"] for p in before}  # each one's last
        victim = next(p["pid"] for p in reversed(before) if p["rank"] == 1)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        # a survivor's step in a later round: world 3, or 4 when the launcher's replacement
        # (started 2 s after the death at the latest) made it into the survivors' formation
        first = wait_for(lambda: next((p for p in read_progress(out) if p["t"] > killed_at
                                       and p["pid"] != victim and p["pid"] in rounds
                                       and p["generation"] > rounds[p["pid"]]), None),
                         60, "a survivor's step in a new round")
        if first["world"] != 3:
            print(f"  (the survivors' first step was in world {first['world']}: the replacement "
                  f"joined the same formation)", flush=True)
        return first["t"] - killed_at
    finally:
        procs.kill_all()


def torchrun_kill(out: Path, rdzv: str = "c10d") -> float:
    procs = Procs(out)
    try:
        rdzv_args = ([f"--master-addr=127.0.0.1", f"--master-port={free_port()}"] if rdzv == "static"
                     else ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=4",
               "--max-restarts=3", *rdzv_args, "torchrun_worker.py", "--out", str(out)]
        procs.start(cmd, env_for())
        original = wait_for(lambda: steps_of(out, 30, 4), 120, "4 torchrun workers at step 30")
        victim = next(p["pid"] for p in reversed(read_progress(out)) if p["rank"] == 1)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        first = wait_for(lambda: next((p for p in read_progress(out) if p["t"] > killed_at
                                       and p["pid"] not in original), None), 120,
                         "a step after torchrun's restart")
        return first["t"] - killed_at
    finally:
        procs.kill_all()


def ours_scale_up(out: Path) -> tuple[float, float, float]:
    etcd = EmbeddedEtcd().start()
    procs = Procs(out)
    try:
        env = env_for(ELASTIC_ETCD=etcd.url, ELASTIC_JOB_ID="bench")
        for _ in range(3):
            procs.start([sys.executable, "elastic_worker.py", "--out", str(out)], env)
        old = wait_for(lambda: steps_of(out, 30, 3), 120, "3 elastic workers at step 30")
        started_at = time.time()
        procs.start([sys.executable, "elastic_worker.py", "--out", str(out)], env)
        first = wait_for(lambda: next((p for p in read_progress(out) if p["pid"] not in old), None),
                         120, "the joiner's first step")
        times = [p["t"] for p in read_progress(out) if p["pid"] in old and p["rank"] == 0]
        window = [t for t in times if started_at - 1 <= t <= first["t"] + 1]
        gaps = [b - a for a, b in zip(window, window[1:])]
        steady = [b - a for a, b in zip(times, times[1:]) if b < started_at]
        return first["t"] - started_at, max(gaps), statistics.median(steady)
    finally:
        procs.kill_all()
        etcd.stop()


def throughput(out: Path, kind: str, steps: int = 1500, pin: bool = False,
               batch: int = 32, commit_part: str = "both") -> float:
    """Steps/s of rank 0 over steps 100..steps of a 2-worker run.

    ``pin`` binds worker i of either side to core i; ``batch`` is samples per worker and step;
    ``commit_part`` is what ours does at each commit (``elastic_worker.py --commit-part``).
    """
    procs = Procs(out)
    pinned = {"BENCH_PIN": "1"} if pin else {}
    etcd = EmbeddedEtcd().start() if kind != "torchrun" else None
    try:
        if kind.startswith("torchrun"):  # "torchrun+etcd": with an idle etcd beside it
            procs.start([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                         "--nproc-per-node=2", "--rdzv-backend=c10d",
                         f"--rdzv-endpoint=127.0.0.1:{free_port()}", "torchrun_worker.py",
                         "--out", str(out), "--steps", str(steps), "--batch", str(batch)],
                        env_for(**pinned))
        else:
            assert etcd is not None
            every = "1" if kind == "ours-commit-1" else "10"
            for core in range(2):
                env = env_for(ELASTIC_ETCD=etcd.url, ELASTIC_JOB_ID="bench", BENCH_CORE=str(core),
                              **pinned)
                procs.start([sys.executable, "elastic_worker.py", "--out", str(out), "--steps",
                             str(steps), "--commit-every", every, "--batch", str(batch),
                             "--commit-part", commit_part], env)
        for proc in procs.procs:
            proc.wait(timeout=300)
        rank0 = [p for p in read_progress(out) if p["rank"] == 0]
        window = [p["t"] for p in rank0 if 100 < p["step"] <= steps]
        return (len(window) - 1) / (window[-1] - window[0])
    finally:
        procs.kill_all()
        if etcd:
            etcd.stop()


def commit_cost_ms(out: Path, every: int = 10, first: int = 100) -> float:
    """What a commit adds to rank 0's step: the median interval that holds a commit minus the
    median of the other intervals (ms), from the per-step progress lines."""
    times = {p["step"]: p["t"] for p in read_progress(out) if p["rank"] == 0}
    with_commit, without = [], []
    for step in range(first + 1, max(times) + 1):
        if step in times and step - 1 in times:
            bucket = with_commit if (step - 1) % every == 0 else without
            bucket.append(times[step] - times[step - 1])
    return (statistics.median(with_commit) - statistics.median(without)) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", "--json", type=Path, default=None,
                        help="where to write the JSON result (default: runs/recovery.json, or "
                             "runs/throughput.json with --throughput-only; runs/ is untracked)")
    parser.add_argument("--recovery-only", action="store_true",
                        help="only the failure cases: SIGKILL without and with a launcher, "
                             "torchrun's restart, SIGSTOP")
    parser.add_argument("--throughput-only", action="store_true",
                        help="only the steady-state comparison, order alternating per rep")
    parser.add_argument("--batch", type=int, default=32,
                        help="with --throughput-only: samples per worker and step (default 32)")
    parser.add_argument("--steps", type=int, default=1500,
                        help="with --throughput-only: steps per run (steps 100.. are timed)")
    parser.add_argument("--control", action="store_true",
                        help="with --throughput-only: torchrun against torchrun with an idle "
                             "etcd beside it, instead of ours (how far identical jobs differ)")
    parser.add_argument("--commit-part", choices=("both", "snapshot", "agreement"),
                        default="both",
                        help="with --throughput-only: what ours does at each commit, to measure "
                             "the cost of the snapshot and of the agreement apart")
    parser.add_argument("--torchft", action="store_true",
                        help="with --recovery-only: torchft as an anchor too (torchft_anchor.py)")
    parser.add_argument("--loader-kills", type=int, default=0, metavar="N",
                        help="only the SIGKILL under elastic run with 2 DataLoader workers, N "
                             "times: its tail (a kill slower than 1 s keeps its folder)")
    parser.add_argument("--pin", action="store_true",
                        help="with --throughput-only: bind worker i of either side to core i")
    args = parser.parse_args()
    if args.out is None:
        args.out = REPO / "runs" / ("throughput.json" if args.throughput_only else "recovery.json")
    args.out = args.out.resolve()
    if args.torchft:
        if not args.recovery_only:
            parser.error("--torchft goes with --recovery-only; add it, or drop --torchft")
        import torchft_anchor
        torchft_anchor.require()
    if os.environ.get("BENCH_NETNS") != "1":
        inner = f"ip link set lo up && exec {sys.executable} {Path(__file__)} " \
                f"--reps {args.reps} --out {shlex.quote(str(args.out))}" \
                + (" --throughput-only" if args.throughput_only else "") \
                + (" --recovery-only" if args.recovery_only else "") \
                + (" --torchft" if args.torchft else "") \
                + (" --pin" if args.pin else "") + (" --control" if args.control else "") \
                + f" --loader-kills {args.loader_kills}" \
                + f" --batch {args.batch} --steps {args.steps} --commit-part {args.commit_part}"
        os.execvpe("unshare", ["unshare", "-n", "sh", "-c", inner],
                   dict(os.environ, BENCH_NETNS="1"))
    if args.loader_kills:
        loader_tail(args.loader_kills, args.out)
        return
    if args.recovery_only:
        recovery_only(args.reps, args.out, args.torchft)
        return
    if args.throughput_only:
        throughput_only(args.reps, args.out, args.pin, args.batch, args.steps,
                        args.control, args.commit_part)
        return
    results: dict[str, list[float]] = {k: [] for k in (
        "ours_kill_s", "torchrun_kill_s", "ours_node_loss_s", "joiner_first_step_s",
        "others_max_pause_s", "steady_step_s", "tput_torchrun", "tput_ours_commit_10",
        "tput_ours_commit_1")}
    with scratch() as root:
        for rep in range(args.reps):
            d = root / f"rep{rep}"
            results["ours_kill_s"].append(ours_fault(mk(d / "kill"), signal.SIGKILL))
            results["torchrun_kill_s"].append(torchrun_kill(mk(d / "torchrun")))
            results["ours_node_loss_s"].append(ours_fault(mk(d / "stop"), signal.SIGSTOP, None))
            joiner, pause, steady = ours_scale_up(mk(d / "scale"))
            results["joiner_first_step_s"].append(joiner)
            results["others_max_pause_s"].append(pause)
            results["steady_step_s"].append(steady)
            for kind in ("torchrun", "ours-commit-10", "ours-commit-1"):
                key = "tput_" + kind.replace("-", "_")
                results[key].append(throughput(mk(d / f"tput-{kind}"), kind))
            print(f"rep {rep}: " + ", ".join(f"{k}={v[-1]:.3f}" for k, v in results.items()),
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    report(results)
    print(f"wrote {args.out}")


def recovery_only(reps: int, json_path: Path, torchft: bool = False) -> None:
    """The failure cases only, each rep in the same order; medians and the ratio to torchrun."""
    results: dict[str, list[float]] = {k: [] for k in (
        "ours_kill_s", "torchrun_kill_s", "ours_launcher_kill_s", "ours_launcher_loader_kill_s",
        "ours_node_loss_s")}
    if torchft:
        import torchft_anchor  # optional: pip install -e '.[bench-torchft]'
        results |= {k: [] for k in torchft_anchor.KEYS}
    with scratch() as root:
        for rep in range(reps):
            d = root / f"rep{rep}"
            results["ours_kill_s"].append(ours_fault(mk(d / "kill"), signal.SIGKILL))
            results["torchrun_kill_s"].append(torchrun_kill(mk(d / "torchrun")))
            results["ours_launcher_kill_s"].append(ours_launcher_kill(mk(d / "launcher")))
            results["ours_launcher_loader_kill_s"].append(
                ours_launcher_kill(mk(d / "loader"), loader_workers=2))
            results["ours_node_loss_s"].append(ours_fault(mk(d / "stop"), signal.SIGSTOP, None))
            if torchft:
                for key, value in torchft_anchor.measure(mk(d / "torchft")).items():
                    results[key].append(value)
            print(f"rep {rep}: " + ", ".join(f"{k}={v[-1]:.3f}" for k, v in results.items()),
                  flush=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1))
    med = {k: statistics.median(v) for k, v in results.items()}
    print("\n| measure | median | all runs |\n|---|---|---|")
    for key, values in results.items():
        print(f"| {key} | {med[key]:.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    ratios = [t / o for o, t in zip(results["ours_kill_s"], results["torchrun_kill_s"])]
    print(f"\nrecovery ratio torchrun/ours: {med['torchrun_kill_s'] / med['ours_kill_s']:.1f}x "
          f"(medians); per rep {', '.join(f'{r:.1f}x' for r in ratios)}")
    print(f"wrote {json_path}")


def loader_tail(kills: int, json_path: Path) -> None:
    """Only the SIGKILL under ``elastic run`` with 2 DataLoader workers, ``kills`` times: the
    tail that a few reps cannot show. A kill whose survivors took longer than ``SLOW_S`` to
    step again keeps its workers' output and events (the folder is printed)."""
    times: list[float] = []
    slow: dict[str, float] = {}
    with scratch() as root:
        for n in range(kills):
            out = mk(root / f"kill{n}")
            times.append(ours_launcher_kill(out, loader_workers=2))
            print(f"kill {n}: {times[-1]:.3f} s", flush=True)
            if times[-1] > SLOW_S:
                kept = Path(tempfile.mkdtemp(prefix="elastic-bench-slow-"))
                shutil.copytree(out, kept, dirs_exist_ok=True)
                slow[str(kept)] = times[-1]
                print(f"  slow: kept {kept}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"ours_launcher_loader_kill_s": times, "slow": slow},
                                    indent=1))
    ordered = sorted(times)
    print(f"{len(times)} kills: median {statistics.median(times):.3f} s, 90th percentile "
          f"{ordered[int(0.9 * (len(ordered) - 1))]:.3f} s, most {ordered[-1]:.3f} s; "
          f"{len(slow)} slower than {SLOW_S:g} s")
    print(f"wrote {json_path}")


def throughput_only(reps: int, json_path: Path, pin: bool, batch: int, steps: int,
                    control: bool = False, commit_part: str = "both") -> None:
    """Steady state only: torchrun and ours (commit every 10), the order alternating per rep.

    With ``control``, the second side is torchrun again with an idle etcd running: an A/A
    comparison that shows how far two runs of the same job differ on this machine.
    """
    pair = ["torchrun", "torchrun+etcd" if control else "ours-commit-10"]
    keys = ["tput_" + k.replace("-", "_").replace("+", "_with_") for k in pair]
    results: dict[str, list[float]] = {key: [] for key in keys}
    if not control:
        results["ours_commit_cost_ms"] = []
    with scratch() as root:
        for rep in range(reps):
            order = [0, 1] if rep % 2 == 0 else [1, 0]
            for i in order:
                out = mk(root / f"rep{rep}-{pair[i]}")
                results[keys[i]].append(throughput(out, pair[i], steps, pin, batch, commit_part))
                if pair[i].startswith("ours"):
                    results["ours_commit_cost_ms"].append(commit_cost_ms(out))
            ratio = results[keys[1]][-1] / results[keys[0]][-1]
            print(f"rep {rep}: {pair[order[0]]} first, ratio {ratio:.3f}", flush=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1))
    print(f"wrote {json_path}")
    ratios = [b / a for a, b in zip(results[keys[0]], results[keys[1]])]
    print("\n| measure | median | all runs |\n|---|---|---|")
    for key, values in results.items():
        digits = 2 if key.endswith("_ms") else 1
        print(f"| {key} | {statistics.median(values):.{digits}f} | "
              f"{', '.join(f'{v:.{digits}f}' for v in values)} |")
    print(f"| ratio per rep | {statistics.median(ratios):.3f} | "
          f"{', '.join(f'{r:.3f}' for r in ratios)} |")


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A folder for one benchmark run's workers: removed after a run that ended well, kept
    (and named) after one that failed, for its workers' output and events."""
    root = Path(tempfile.mkdtemp(prefix="elastic-bench-"))
    try:
        yield root
    except BaseException:
        print(f"kept the failed run's workers' output and events under {root}", flush=True)
        raise
    shutil.rmtree(root, ignore_errors=True)


def mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def report(results: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in results.items()}
    print("\n| measure | median | all runs |\n|---|---|---|")
    for key, values in results.items():
        print(f"| {key} | {med[key]:.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    print(f"\nrecovery ratio torchrun/ours: {med['torchrun_kill_s'] / med['ours_kill_s']:.1f}x")
    print(f"throughput ours(commit/10) / torchrun: "
          f"{med['tput_ours_commit_10'] / med['tput_torchrun']:.3f}")
    print(f"throughput ours(commit/1) / torchrun: "
          f"{med['tput_ours_commit_1'] / med['tput_torchrun']:.3f}")


if __name__ == "__main__":
    main()
