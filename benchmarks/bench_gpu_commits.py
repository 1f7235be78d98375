"""A commit every step on a GPU, by model size: plain DDP against ours, copy-free and snapshot.

Usage: ``python benchmarks/bench_gpu_commits.py [--sizes 1m,10m,100m] [--reps 2] [--batch 1024]
[--device cuda] [--out DIR]``. Prints a table; writes ``gpu-commits.json`` under ``--out``.

The model of ``bench_commit_sweep.py`` (the 3-layer MLP of ``workload.py`` at ~1M, ~10M and ~100M
parameters, Adam), one worker a job on GPU 0: an NCCL world of one, since NCCL refuses two
ranks on one GPU. The jobs: ``torchrun`` (plain DDP under torchrun: the anchor), ``copy-free``
(``elastic run``, every step inside ``commit_step()``) and ``snapshot`` (``elastic run``,
``commit()`` after every step: the parameters and both Adam moments copied to pinned host
memory). The jobs of one size run one after another, the order rotating each rep; nothing else
uses the GPU, so they do not need to take turns as on the shared CPU machine. A job's steps/s
counts its steps after the first quarter (warm-up); each ratio is a job's steps/s over the
anchor's of the same rep. ``--device cpu`` runs the same jobs with gloo (a dry run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import env_for, read_progress  # noqa: E402
from elastic.cluster.links.ports import free_port  # noqa: E402

JOBS = ("torchrun", "copy-free", "snapshot")  # the first is the anchor
STEPS = {"1m": 1500, "10m": 800, "100m": 200}
JOB_TIMEOUT_S = 240


def command(job: str, size: str, steps: int, batch: int, device: str, out: Path) -> list[str]:
    worker = ["--out", str(out), "--steps", str(steps), "--batch", str(batch), "--size", size,
              "--optimizer", "adam", "--device", device]
    if job == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}", "torchrun_worker.py", *worker]
    part = ["--commit-part", "copy-free"] if job == "copy-free" else []
    launcher = Path(sys.executable).with_name("elastic")
    return [str(launcher) if launcher.exists() else "elastic", "run", "-n", "1",
            "--log-dir", str(out / "events"), "elastic_worker.py", *worker,
            "--commit-every", "1", *part]


def run_job(job: str, size: str, steps: int, batch: int, device: str, out: Path) -> dict:
    """Runs one job to its last step; returns its steps/s after warm-up."""
    out.mkdir(parents=True)
    with open(out / "log.txt", "wb") as log:
        proc = subprocess.Popen(command(job, size, steps, batch, device, out), env=env_for(),
                                cwd=HERE, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            code = None
    times = [p["t"] for p in read_progress(out) if p["rank"] == 0]
    if code != 0 or len(times) < steps:
        tail = (out / "log.txt").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{job} at {size} exited {code} after {len(times)} of {steps} "
                           f"steps; its log ends:\n{tail}")
    measured = times[len(times) // 4:]
    return {"steps_per_s": (len(measured) - 1) / (measured[-1] - measured[0]),
            "measured_steps": len(measured) - 1}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1m,10m,100m")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--batch", type=int, default=1024, help="samples per step")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps-scale", type=float, default=1.0,
                   help="multiplies each size's step count (a short dry run: 0.1)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sizes = args.sizes.split(",")
    unknown = sorted(set(sizes) - set(STEPS))
    if unknown:
        p.error(f"unknown sizes {unknown}; choose from {','.join(STEPS)}")
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-commits-"))
    results: dict = {"batch": args.batch, "device": args.device, "sizes": {}}
    for size in sizes:
        steps = max(20, int(STEPS[size] * args.steps_scale))
        reps = []
        for rep in range(args.reps):
            order = JOBS[rep % len(JOBS):] + JOBS[:rep % len(JOBS)]
            rates = {}
            for job in order:
                t0 = time.monotonic()
                rates[job] = run_job(job, size, steps, args.batch, args.device,
                                     root / f"{size}-{rep}-{job}")
                print(f"{size} rep {rep} {job}: {rates[job]['steps_per_s']:.1f} steps/s "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
            anchor = rates["torchrun"]["steps_per_s"]
            reps.append({"rates": rates, "ratios": {j: rates[j]["steps_per_s"] / anchor
                                                    for j in JOBS[1:]}})
        results["sizes"][size] = {
            "steps": steps, "reps": reps,
            "median_ratio": {j: statistics.median(r["ratios"][j] for r in reps)
                             for j in JOBS[1:]}}
    (root / "gpu-commits.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'size':>5} {'torchrun steps/s':>17} {'copy-free/torchrun':>19} "
          f"{'snapshot/torchrun':>18}")
    for size, found in results["sizes"].items():
        anchor = statistics.median(r["rates"]["torchrun"]["steps_per_s"] for r in found["reps"])
        per_rep = {j: ", ".join(f"{r['ratios'][j]:.3f}" for r in found["reps"]) for j in JOBS[1:]}
        print(f"{size:>5} {anchor:>17.1f} {per_rep['copy-free']:>19} {per_rep['snapshot']:>18}")
    print(f"wrote {root / 'gpu-commits.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
