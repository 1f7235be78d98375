"""The benchmarks' one entry point: ``python -m benchmarks NAME [--out PATH] [ARGS...]``
(``make bench NAME=...``) runs the benchmark NAME with the settings of its claim in
``RESULTS.md`` and writes its result to ``PATH``, by default ``benchmarks/results/NAME.json``
(the latest, overwritten), and its plot where it has one.

Owns the registry of benchmarks (a name, its script, the arguments of its claim, how the script
hands back its result); the scripts themselves stay runnable on their own. ARGS after NAME,
but ``--out``, are passed to the script after the registered ones (argparse keeps the last of a
repeated option).
``python -m benchmarks`` alone lists the names.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"


@dataclass(frozen=True)
class Benchmark:
    """One registered benchmark.

    Attributes:
        script: the script under benchmarks/.
        args: the arguments of the claim in RESULTS.md.
        result: how the script hands back its result: ``"file"`` (it writes JSON to
            ``--out PATH``), ``"dir"`` (it writes JSON files under ``--out DIR``: merged into
            one, by file name) or ``"stdout"`` (it prints a table: kept as text).
        plot: a command that draws the plot from the result (``{result}`` is its path).
        about: one line for the listing.
    """

    script: str
    args: tuple[str, ...]
    result: str
    about: str
    plot: tuple[str, ...] = ()


REGISTRY: dict[str, Benchmark] = {
    "recovery": Benchmark(
        "bench_recovery.py", ("--recovery-only", "--reps", "5"), "file",
        "SIGKILL/SIGSTOP of 1 of 4 workers -> first step in the new world, against torchrun "
        "(needs root: unshare -n)"),
    "scale-up": Benchmark(
        "bench_recovery.py", ("--reps", "5"), "file",
        "the whole recovery run, with a 4th worker joining and the sequential steady state "
        "(needs root)"),
    "recovery-torchft": Benchmark(
        "bench_recovery.py", ("--recovery-only", "--reps", "5", "--torchft"), "file",
        "the recovery run with torchft beside it, its defaults and lowest timeouts (needs root "
        "and the bench-torchft extra)"),
    "interleaved": Benchmark(
        "bench_interleaved.py", ("--pairs", "16", "--runs", "14"), "file",
        "steady-state steps/s against plain DDP under torchrun, jobs taking turns (needs root)"),
    "commit-sweep": Benchmark(
        "bench_commit_sweep.py", ("--sizes", "1m,10m", "--runs", "2"), "file",
        "a commit every step, 1M/10M parameters, against plain DDP (needs root; 100M: "
        "--sizes 100m --jobs torchrun,copy-free)"),
    "commit-sweep-torchft": Benchmark(
        "bench_commit_sweep.py", ("--sizes", "1m,10m", "--runs", "2", "--jobs", "torchrun,torchft"),
        "file", "torchft's DDP with should_commit every step against plain DDP (needs root and "
        "the bench-torchft extra)"),
    "survivor-sync": Benchmark(
        "bench_survivor_sync.py", ("--reps", "2"), "file",
        "what the survivors of a 100M-parameter job move when one worker dies"),
    "reshard": Benchmark(
        "bench_reshard.py", (), "file",
        "FSDP2, 8 ranks, ~100M parameters: kill 2, reshard in memory to 6, 2 join back to 8, "
        "against DCP save at 8 + a restart + load at 6 (--small on a loaded machine)"),
    "reshard-steady": Benchmark(
        "bench_reshard.py", ("--steady", "--rounds", "5", "--split"), "file",
        "FSDP2 steady state: the plain loop against ours (a commit every 10 steps with buddy "
        "copies) and ours without commits, taking turns; 4 ranks, 8.4M parameters"),
    "spares": Benchmark(
        "bench_spares.py", ("--reps", "4"), "file",
        "a warm spare against a cold restart under elastic run"),
    "joiner-feed": Benchmark(
        "bench_joiner_feed.py", ("--params", "100m", "--reps", "2"), "file",
        "a joiner fed 100M parameters with Adam (1.2 GB) against loopback TCP, and the running "
        "workers' pause (--small: 10M, under load)"),
    "soak": Benchmark(
        "soak.py", ("--minutes", "30", "--seed", "1"), "file",
        "30 minutes of seeded random faults: hangs, samples lost, training lost per fault"),
    "goodput": Benchmark(
        "soak.py", ("--fault-every", "60", "--duration", "1800", "--turns", "1"), "file",
        "useful work under a mixed fault a minute over fault-free turns of the same job (95 min)"),
    "checkpoint": Benchmark(
        "bench_checkpoint.py", ("--repeats", "7"), "stdout",
        "a 192 MiB checkpoint saved and loaded against torch.save and dd"),
    "checkpoint-io": Benchmark(
        "bench_checkpoint_io.py", ("--repeats", "3"), "file",
        "checkpoint load peak RSS vs the payload (streamed vs whole-file), save vs raw fsspec "
        "write (--small: a quick check)"),
    "equivalence": Benchmark(
        "plot_equivalence.py", ("--out", str(REPO / "docs" / "loss_curves.png")), "stdout",
        "an elastic 3->2->3->2 job against an uninterrupted one (plot: docs/loss_curves.png)"),
    "membership": Benchmark(
        "bench_membership.py", ("--sizes", "1000", "--declared-size", "--lease-ttl", "3"),
        "file", "1,000 simulated members: first round and re-formation after a death"),
    "membership-curve": Benchmark(
        "bench_membership.py", ("--sizes", "10,100,300,1000", "--declared-size", "--lease-ttl",
                                "3", "--label", "after"), "file",
        "membership from 10 to 1,000 members (plot: docs/membership-scale.png)",
        plot=("plot_membership.py", "{result}", "--out", str(REPO / "docs" / "membership-scale.png"))),
    "keepalive": Benchmark(
        "bench_keepalive.py", ("--clients", "100", "--interval", "0.15"), "file",
        "lease renewals: one stream per connection against a stream per renewal"),
    "round-store": Benchmark(
        "bench_round_store.py", ("--sizes", "4,16,32"), "file",
        "forming one gloo group of N ranks through the round store: etcd's work"),
    "tls-formation": Benchmark(
        "bench_tls_formation.py", ("--reps", "5"), "stdout",
        "formation against a plain etcd and one with TLS and authentication"),
    "rollback-compiled": Benchmark(
        "rollback_compiled.py", (), "stdout",
        "the rollback matrix's torch.compile case (CPU inductor): kills and joiners, bitwise end"),
    "gpu-check": Benchmark(
        "gpu_check.py", (), "dir", "the NCCL and CUDA paths on a real GPU (exits 1 on a failed check)"),
    "gpu-fsdp": Benchmark(
        "gpu_fsdp.py", (), "dir",
        "FSDP2 on a real GPU: the example (NCCL world of one, bf16), the sharded commit's host "
        "copy and buddy send from device memory (exits 1 on a failed check; --device cpu: dry "
        "run)"),
    "gpu-commits": Benchmark(
        "bench_gpu_commits.py", ("--sizes", "1m,10m,100m", "--reps", "2"), "dir",
        "a commit every step on a GPU, against plain DDP"),
}


def run(name: str, extra: list[str], out: Path | None = None) -> int:
    """Runs benchmark ``name``, writes its result to ``out`` (default ``results/NAME.json``)
    and its plot; the script's exit status (the result is written only when it is 0)."""
    bench = REGISTRY[name]
    out = (out or RESULTS / f"{name}.json").absolute()
    command = [sys.executable, str(HERE / bench.script), *bench.args, *extra]
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as scratch:
        target = Path(scratch) / ("result.json" if bench.result == "file" else "out")
        if bench.result != "stdout":
            command += ["--out", str(target)]
        print("==>", " ".join(command), flush=True)
        ran = subprocess.run(command, cwd=REPO, text=True,
                             stdout=subprocess.PIPE if bench.result == "stdout" else None)
        if ran.returncode != 0:
            print(f"{name}: the script exited {ran.returncode}; {out} left as it was",
                  file=sys.stderr)
            return ran.returncode
        if bench.result == "stdout":
            print(ran.stdout, end="")
            result = {"command": command[1:], "stdout": ran.stdout}
        elif bench.result == "dir":
            result = {p.name: json.loads(p.read_text()) for p in sorted(target.glob("*.json"))}
        else:
            result = json.loads(target.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"==> wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    if bench.plot:
        plot = [sys.executable, str(HERE / bench.plot[0]),
                *(a.replace("{result}", str(out)) for a in bench.plot[1:])]
        return subprocess.run(plot, cwd=REPO).returncode
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        width = max(map(len, REGISTRY))
        print("usage: python -m benchmarks NAME [--out PATH] [ARGS...]   "
              "(make bench NAME=... ARGS=...)")
        for name, bench in REGISTRY.items():
            print(f"  {name:<{width}}  {bench.about}")
        return 0
    name, extra = argv[0], argv[1:]
    if name not in REGISTRY:
        print(f"no benchmark named {name!r}: pick one of {', '.join(REGISTRY)} "
              "(python -m benchmarks lists them)", file=sys.stderr)
        return 2
    where = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", add_help=False,
                                    allow_abbrev=False)
    where.add_argument("--out", type=Path, help="where the result goes")
    known, rest = where.parse_known_args(extra)
    return run(name, rest, known.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
