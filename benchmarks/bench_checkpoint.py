"""Benchmark: durable checkpoint save/load on local disk against torch.save + fsync and dd.

Run: ``python benchmarks/bench_checkpoint.py [--mb 200] [--repeats 3] [--dir DIR]``.
Prints a markdown table (medians over the repeats). Every measurement writes the same state
(~``--mb`` MB of float32 tensors in a model/optimizer-shaped dict) into a fresh temporary
directory. Before each load the file is evicted from the page cache (posix_fadvise DONTNEED), and
every loaded tensor is read once, so lazy (mmap) loading is not flattered.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from elastic.checkpoint import CheckpointStore  # noqa: E402


def make_state(total_mb: int) -> dict[str, Any]:
    """A model + Adam-shaped state dict of about ``total_mb`` MB (float32)."""
    per_tensor = 4 << 20  # 4 MiB per tensor, like a mid-sized linear layer
    n = max(1, (total_mb << 20) // per_tensor // 3)
    shape = (1024, per_tensor // 4 // 1024)
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(shape, generator=gen) for i in range(n)}
    opt = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(shape, generator=gen),
               "exp_avg_sq": torch.rand(shape, generator=gen)} for i in range(n)}
    return {"model": model, "optimizer": {"state": opt, "param_groups": [{"lr": 1e-3}]},
            "epoch": 3}


def state_bytes(obj: Any) -> int:
    """Total tensor bytes in a nested state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def touch(obj: Any) -> float:
    """Reads every tensor once (forces mmap'd pages in)."""
    if isinstance(obj, torch.Tensor):
        return float(obj.sum())
    if isinstance(obj, dict):
        return sum(touch(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(touch(v) for v in obj)
    return 0.0


def evict(path: Path) -> None:
    """Drops a file's clean pages from the page cache so the next read hits the disk."""
    for file in [path] if path.is_file() else path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_dd(work: Path, mb: int) -> float:
    """Seconds for dd to write ``mb`` MiB with fdatasync (the raw disk)."""
    out = work / "dd.bin"
    cmd = ["dd", "if=/dev/zero", f"of={out}", "bs=1M", f"count={mb}", "conv=fdatasync"]
    seconds = timed(lambda: subprocess.run(cmd, check=True, capture_output=True))
    out.unlink()
    return seconds


def bench_torch(work: Path, state: dict[str, Any]) -> tuple[float, float]:
    """Seconds for torch.save + fsync, and for torch.load (cold cache, weights_only, touched)."""
    path = work / "plain.pt"

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    save_s = timed(save)
    evict(path)
    load_s = timed(lambda: touch(torch.load(path, weights_only=True)))
    path.unlink()
    return save_s, load_s


def bench_ours(work: Path, state: dict[str, Any]) -> tuple[float, ...]:
    """Seconds: save, load (cold, touched), save_async blocking (first, steady), async total."""
    root = work / "ours"
    store = CheckpointStore(str(root), keep=1)
    save_s = timed(lambda: store.save(1, state, {"epoch": 3}))
    evict(root)
    load_s = timed(lambda: touch(store.load().state_dict))
    start = time.perf_counter()
    future = store.save_async(2, state, {"epoch": 3})
    first_blocked_s = time.perf_counter() - start  # allocates the staging buffers
    future.result(timeout=600)
    start = time.perf_counter()
    future = store.save_async(3, state, {"epoch": 4})
    blocked_s = time.perf_counter() - start  # steady state: copies into reused buffers
    future.result(timeout=600)
    async_total_s = time.perf_counter() - start
    store.close()
    shutil.rmtree(root)
    return save_s, load_s, first_blocked_s, blocked_s, async_total_s


def run(mb: int, repeats: int, base: str | None) -> dict[str, list[float]]:
    state = make_state(mb)
    results: dict[str, list[float]] = {k: [] for k in (
        "dd", "torch_save", "torch_load", "ours_save", "ours_load", "first_blocked", "blocked",
        "async_total")}
    results["bytes"] = [float(state_bytes(state))]
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=base))
    try:
        for _ in range(repeats):
            results["dd"].append(bench_dd(work, round(results["bytes"][0] / 2**20)))
            save_s, load_s = bench_torch(work, state)
            results["torch_save"].append(save_s)
            results["torch_load"].append(load_s)
            ours = bench_ours(work, state)
            keys = ("ours_save", "ours_load", "first_blocked", "blocked", "async_total")
            for key, value in zip(keys, ours):
                results[key].append(value)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def table(results: dict[str, list[float]], repeats: int) -> str:
    mib = results["bytes"][0] / 2**20
    med = {k: statistics.median(v) for k, v in results.items()}
    best = {k: min(v) for k, v in results.items()}
    keys = ["dd", "torch_save", "ours_save", "torch_load", "ours_load", "first_blocked",
            "blocked", "async_total"]
    rate = lambda s: f"{mib / s:,.0f} MiB/s"  # noqa: E731
    rows = [
        ("raw disk: dd bs=1M conv=fdatasync (write)", med["dd"], rate(med["dd"]), "1.00x dd"),
        ("torch.save + fsync", med["torch_save"], rate(med["torch_save"]),
         f"{med['dd'] / med['torch_save']:.2f}x dd"),
        ("CheckpointStore.save (sha256, manifest, fsyncs)", med["ours_save"],
         rate(med["ours_save"]), f"{med['dd'] / med['ours_save']:.2f}x dd"),
        ("torch.load weights_only (cold cache)", med["torch_load"], rate(med["torch_load"]), ""),
        ("CheckpointStore.load (verify sha256, mmap; cold)", med["ours_load"],
         rate(med["ours_load"]), f"{med['torch_load'] / med['ours_load']:.2f}x torch.load"),
        ("save_async: caller blocked, first call (allocates staging)", med["first_blocked"], "",
         f"{med['first_blocked'] / med['ours_save']:.3f}x sync save"),
        ("save_async: caller blocked, steady state (snapshot copy)", med["blocked"], "",
         f"{med['blocked'] / med['ours_save']:.3f}x sync save"),
        ("save_async: until the future resolves", med["async_total"],
         rate(med["async_total"]), ""),
    ]
    lines = [f"State: {mib:.0f} MiB of float32 tensors; median of {repeats} runs; "
             f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
             f"{os.getloadavg()[0]:.2f} at the end.", "",
             "| operation | median s | best s | throughput (median) | ratio (median) |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {s:.3f} | {best[key]:.3f} | {tp} | {ratio} |"
              for key, (name, s, tp, ratio) in zip(keys, rows)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="state size in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = parser.parse_args()
    print(table(run(args.mb, args.repeats, args.dir), args.repeats))


if __name__ == "__main__":
    main()
