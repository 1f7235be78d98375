"""Benchmark: checkpoint load peak memory (vs the payload) and save throughput (vs a raw write).

Run: ``python benchmarks/bench_checkpoint_io.py [--mb 256] [--repeats 3] [--small] [--out F]``.

Load: each measurement runs in a fresh process, which saves the state, resets its peak RSS
(``/proc/self/clear_refs``), loads the checkpoint, reads every tensor once, and reports how far
its peak RSS rose, as a multiple of the payload size. Two filesystems: a local directory (hashed
in chunks, then memory-mapped) and ``memory://`` (the object-store path: streamed into a spool),
each against the whole-file read that loads used before (``cat_file``, sha256, ``torch.load``
of the bytes) in the same run.

Save: ``CheckpointStore.save`` (serialise, sha256, manifest, fsyncs) on a local directory
against a raw fsspec write of the same bytes (already serialised: the anchor does strictly less)
with an fsync, same run, medians of the repeats. ``--small`` (16 MiB, 1 repeat) checks that the
script works on a loaded machine; its figures are not claims.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_checkpoint import make_state, state_bytes, touch  # noqa: E402
from elastic.checkpoint import CheckpointStore  # noqa: E402


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(key + ":"))


def _whole_file_load(store: CheckpointStore, url: str) -> Any:
    """What a load did before streaming: the whole file into memory, hashed, then decoded."""
    ref = store.latest()
    assert ref is not None
    fs, root = fsspec.core.url_to_fs(url)
    [(name, entry)] = ref.manifest.files.items()
    data = fs.cat_file(f"{root.rstrip('/')}/{ref.step:012d}/{name}")
    assert hashlib.sha256(data).hexdigest() == entry.sha256
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def child(url: str, method: str, mb: int) -> dict[str, float]:
    """In a fresh process: saves ``mb`` MiB under ``url``, then loads it by ``method`` and
    returns the peak RSS growth of the load (tensors all read) and the payload size."""
    state = make_state(mb)
    payload = state_bytes(state)
    store = CheckpointStore(url, keep=None)
    store.save(1, state)
    del state
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current RSS
    base = _status("VmRSS")
    start = time.perf_counter()
    loaded = store.load().state_dict if method == "store" else _whole_file_load(store, url)
    touch(loaded)
    seconds = time.perf_counter() - start
    return {"payload": payload, "growth": _status("VmHWM") - base, "load_s": seconds}


def measure_load(work: Path, mb: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for fs_name in ("local", "memory"):
        for method in ("store", "whole-file"):
            url = (str(work / f"load-{method}") if fs_name == "local"
                   else f"memory://bench-{os.getpid()}/{method}")
            ran = subprocess.run([sys.executable, __file__, "--child", url, method, str(mb)],
                                 check=True, capture_output=True, text=True, timeout=1200)
            out[f"{fs_name}/{method}"] = json.loads(ran.stdout.strip().splitlines()[-1])
            shutil.rmtree(work / f"load-{method}", ignore_errors=True)
    return out


def _raw_write(path: Path, data: bytes) -> None:
    """A raw fsspec write of ``data`` in 8 MiB calls, then fsync (the anchor)."""
    fs = fsspec.filesystem("file")
    view = memoryview(data)
    with fs.open(str(path), "wb") as f:
        for start in range(0, len(view), 8 << 20):
            f.write(view[start:start + (8 << 20)])
        f.flush()
        os.fsync(f.fileno())


def measure_save(work: Path, mb: int, repeats: int) -> dict[str, Any]:
    state = make_state(mb)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    del buffer
    raw_s, ours_s = [], []
    for i in range(repeats):
        start = time.perf_counter()
        _raw_write(work / "raw.bin", data)
        raw_s.append(time.perf_counter() - start)
        (work / "raw.bin").unlink()
        store = CheckpointStore(str(work / f"save-{i}"), keep=1)
        start = time.perf_counter()
        store.save(1, state)
        ours_s.append(time.perf_counter() - start)
        shutil.rmtree(work / f"save-{i}")
    raw, ours = statistics.median(raw_s), statistics.median(ours_s)
    return {"bytes": len(data), "raw_s": raw_s, "ours_s": ours_s, "raw_median_s": raw,
            "ours_median_s": ours, "ratio": raw / ours}


def report(result: dict[str, Any]) -> str:
    save = result["save"]
    mib = save["bytes"] / 2**20
    lines = [f"State {mib:.0f} MiB; torch {torch.__version__}; {os.cpu_count()} CPUs; load "
             f"average {os.getloadavg()[0]:.2f} at the end.", "",
             "| load (fresh process, every tensor read) | peak RSS growth | x payload | s |",
             "|---|---:|---:|---:|"]
    for name, m in result["load"].items():
        lines.append(f"| {name} | {m['growth'] / 2**20:.0f} MiB | "
                     f"{m['growth'] / m['payload']:.2f}x | {m['load_s']:.2f} |")
    lines += ["", "| save (local dir, median of repeats) | s | MiB/s |", "|---|---:|---:|",
              f"| raw fsspec write + fsync (anchor) | {save['raw_median_s']:.3f} | "
              f"{mib / save['raw_median_s']:,.0f} |",
              f"| CheckpointStore.save | {save['ours_median_s']:.3f} | "
              f"{mib / save['ours_median_s']:,.0f} |",
              f"| ratio (raw s / ours s) | {save['ratio']:.2f}x | |"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="state size in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true",
                        help="16 MiB, 1 repeat: checks the script, not a claim")
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--child", nargs=3, metavar=("URL", "METHOD", "MB"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        url, method, mb = args.child
        print(json.dumps(child(url, method, int(mb))))
        return
    mb, repeats = (16, 1) if args.small else (args.mb, args.repeats)
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-io-", dir=args.dir))
    try:
        result = {"mb": mb, "repeats": repeats, "small": args.small,
                  "load": measure_load(work, mb), "save": measure_save(work, mb, repeats),
                  "loadavg": os.getloadavg()[0]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
