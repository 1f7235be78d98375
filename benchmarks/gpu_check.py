"""The NCCL and CUDA paths on a real GPU, in one run: what the CPU-only suite cannot check.

Usage: ``python benchmarks/gpu_check.py [--cycles 50] [--out DIR]
[--parts versions,cycles,release,state,sync]``. Prints one line per check and writes everything
as ``gpu-check-{parts}.json`` under ``--out``. Exits 1 when a check fails. ``--backend gloo``
runs the same code on the CPU (a dry run of the script).

- ``versions``: torch, CUDA, NCCL, the GPU and its driver.
- ``cycles``: an NCCL world of one formed through ``ProcessGroup`` (the NCCL environment set,
  ``device_id`` given), one all-reduce checked, the group released (its communicators aborted on
  the abort thread) and destroyed, ``--cycles`` times in one process: seconds per phase, and the
  process's resident memory, threads and CUDA memory after each cycle.
- ``release``: where the time of ``cycles``' release goes (see ``release_breakdown``).
- ``state``: a CUDA model with Adam in a ``TrainState``. A snapshot commit (pinned host buffers,
  non-blocking copies on a side stream), steps, ``restore``: parameters and Adam moments equal
  the commit's bit for bit. A copy-free commit (``commit_live``): its payload is the live CUDA
  tensors, and ``restore`` leaves them as they are. The snapshot commit's time against copying
  the same tensors blocking into pageable memory, one at a time.
- ``sync``: two processes on the one GPU (gloo: NCCL refuses two ranks on one GPU). Rank 0 trains
  and commits, rank 1 holds a fresh model; after ``TrainState.sync(0)`` both hold the same
  parameters and optimizer state (SHA-256 of every tensor's bytes). Then each process alone
  syncs over an NCCL world of one (the CUDA transport of ``state.sync``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.cluster.links.ports import free_port
from elastic.cluster.links.process_group import ProcessGroup
from elastic.state import TrainState

PARTS = ("versions", "cycles", "release", "state", "sync")
HIDDEN = 4096  # the state checks' MLP: ~17M parameters, ~200 MB of state with Adam's moments


def versions() -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__,
             "cuda": torch.version.cuda, "gpus_visible": torch.cuda.device_count()}
    if torch.cuda.is_available():
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        found["gpu"] = torch.cuda.get_device_name(0)
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               check=False)
        found["driver"] = query.stdout.strip() or query.stderr.strip()
    return found


def _proc_status() -> dict[str, int]:
    """Resident memory (KiB) and thread count of this process, from /proc."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            fields[key] = int(value.split()[0])
    return fields


def cycles(n: int, backend: str) -> dict:
    """Forms, uses, releases and destroys a world of one ``n`` times in this process."""
    device_index = 0 if backend == "nccl" else None
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    rows = []
    for i in range(n):
        group = ProcessGroup(backend, timeout=timedelta(seconds=60), skip_ports=frozenset(),
                             form_timeout=timedelta(seconds=30), device_index=device_index)
        t0 = time.perf_counter()
        group.form(dist.HashStore(), rank=0, world_size=1)
        t1 = time.perf_counter()
        x = torch.full((1 << 20,), float(i + 1), device=device)
        dist.all_reduce(x)
        ok = bool((x == i + 1).all().item())
        t2 = time.perf_counter()
        group.release(f"cycle {i}")
        group.destroy()
        t3 = time.perf_counter()
        status = _proc_status()
        row = {"cycle": i, "form_s": t1 - t0, "collective_s": t2 - t1, "release_s": t3 - t2,
               "total_s": t3 - t0, "result_ok": ok, "rss_mib": status["VmRSS"] / 1024,
               "threads": status["Threads"]}
        if backend == "nccl":
            free, total = torch.cuda.mem_get_info(0)
            row["cuda_allocated_mib"] = torch.cuda.memory_allocated(0) / 2**20
            row["gpu_used_mib"] = (total - free) / 2**20
        rows.append(row)
    totals = [r["total_s"] for r in rows]
    first, last = rows[0], rows[-1]
    summary = {"cycles": n, "backend": backend, "all_results_ok": all(r["result_ok"] for r in rows),
               "median_cycle_s": statistics.median(totals), "max_cycle_s": max(totals),
               "median_form_s": statistics.median(r["form_s"] for r in rows),
               "median_release_s": statistics.median(r["release_s"] for r in rows),
               "rss_mib_after_first": first["rss_mib"], "rss_mib_after_last": last["rss_mib"],
               "threads_after_first": first["threads"], "threads_after_last": last["threads"],
               "is_initialized_after": dist.is_initialized()}
    if backend == "nccl":
        summary.update(gpu_used_mib_after_first=first["gpu_used_mib"],
                       gpu_used_mib_after_last=last["gpu_used_mib"])
    return {"summary": summary, "rows": rows}


def release_breakdown(n: int, backend: str) -> dict:
    """Where the release of a world of one goes, ``n`` cycles a variant: ours (the abort on its
    thread, then ``destroy``), torch's abort and ``destroy_process_group`` timed apart, a
    ``destroy_process_group`` with no abort; each with torch's NCCL heartbeat monitor on (its
    default) and off (``TORCH_NCCL_ENABLE_MONITORING=0``, read when a group is made)."""
    device_index = 0 if backend == "nccl" else None
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    variants = {}
    for monitoring in ("1", "0"):
        os.environ["TORCH_NCCL_ENABLE_MONITORING"] = monitoring
        for variant in ("ours", "abort-then-destroy", "destroy-only"):
            first, second = [], []
            for _ in range(n):
                group = ProcessGroup(backend, timeout=timedelta(seconds=60),
                                     skip_ports=frozenset(), form_timeout=timedelta(seconds=30),
                                     device_index=device_index)
                group.form(dist.HashStore(), rank=0, world_size=1)
                x = torch.ones(1 << 20, device=device)
                dist.all_reduce(x)
                x.sum().item()
                t0 = time.perf_counter()
                if variant == "ours":
                    group.release("measured")
                    if group._aborting is not None:
                        group._aborting.join()
                elif variant == "abort-then-destroy" and backend == "nccl":
                    dist.distributed_c10d._abort_process_group(dist.group.WORLD)
                t1 = time.perf_counter()
                if variant == "ours":
                    group.destroy()
                elif dist.is_initialized():
                    dist.destroy_process_group()
                t2 = time.perf_counter()
                first.append(t1 - t0)
                second.append(t2 - t1)
            variants[f"monitoring={monitoring} {variant}"] = {
                "abort_s_median": statistics.median(first),
                "destroy_s_median": statistics.median(second),
                "total_s_max": max(a + b for a, b in zip(first, second))}
    os.environ.pop("TORCH_NCCL_ENABLE_MONITORING")
    return {"summary": variants}


def _model(device: torch.device, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, 10)).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    for _ in range(n):
        x = torch.randn(256, HIDDEN, device=device, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and every tensor of the optimizer's state, in a fixed order."""
    found = [p.detach() for p in model.parameters()]
    for group in opt.param_groups:
        for p in group["params"]:
            found += [v for _, v in sorted(opt.state[p].items()) if torch.is_tensor(v)]
    return found


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_checks(device: torch.device, commits: int = 10) -> dict:
    model, opt = _model(device, seed=0)
    _steps(model, opt, 3, seed=1)
    devices = [t.device for t in _tensors(model, opt)]  # Adam keeps its step count on the CPU
    state = TrainState(model=model, optimizer=opt, step=3)
    state.commit()
    committed = [t.clone() for t in _tensors(model, opt)]
    _steps(model, opt, 5, seed=2)
    state.step = 8
    moved = not all(torch.equal(a, b) for a, b in zip(committed, _tensors(model, opt)))
    state.restore()
    restored = all(torch.equal(a, b) for a, b in zip(committed, _tensors(model, opt)))
    on_device = [t.device for t in _tensors(model, opt)] == devices
    result = {"device": str(device), "parameters": sum(p.numel() for p in model.parameters()),
              "state_mib": sum(t.numel() * t.element_size() for t in committed) / 2**20,
              "steps_changed_the_state": moved, "restore_equals_commit": restored,
              "restored_on_device": on_device, "plain_value_restored": state.step == 3}

    _steps(model, opt, 2, seed=3)
    state.commit_live()
    live = {t.data_ptr() for t in _tensors(model, opt)}
    payload = state.committed()["objects"]
    in_payload = [t for t in _walk(payload) if t.device == device]
    before = [t.clone() for t in _tensors(model, opt)]
    state.restore()
    result["copy_free_payload_is_live"] = bool(in_payload) and all(
        t.data_ptr() in live for t in in_payload)
    result["copy_free_restore_keeps_live"] = all(
        torch.equal(a, b) for a, b in zip(before, _tensors(model, opt)))

    result.update(_commit_timing(state, model, opt, device, commits))
    return result


def _walk(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _walk(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _walk(value)


def _commit_timing(state: TrainState, model, opt, device: torch.device, n: int) -> dict:
    """Seconds per snapshot commit against blocking copies into pageable memory."""
    def synced() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    ours, blocking = [], []
    for _ in range(n):
        t0 = synced()
        state.commit()
        ours.append(time.perf_counter() - t0)
        t0 = synced()
        copies = [t.to("cpu") for t in _tensors(model, opt)]
        blocking.append(time.perf_counter() - t0)
        del copies
    size = sum(t.numel() * t.element_size() for t in _tensors(model, opt))
    return {"commit_s_median": statistics.median(ours),
            "commit_gb_per_s": size / statistics.median(ours) / 1e9,
            "blocking_pageable_s_median": statistics.median(blocking),
            "blocking_pageable_gb_per_s": size / statistics.median(blocking) / 1e9}


def _sync_rank(rank: int, port: int, backend: str, results: dict) -> None:
    """One of two processes on one GPU: a gloo group, rank 0's commit synced to rank 1; then
    an NCCL world of one of this process alone."""
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    group = ProcessGroup("gloo", timeout=timedelta(seconds=60), skip_ports=frozenset(),
                         form_timeout=timedelta(seconds=30))
    group.form(dist.PrefixStore("pair/", store), rank=rank, world_size=2)
    model, opt = _model(device, seed=rank + 10)
    _steps(model, opt, 1, seed=rank)  # both ranks hold Adam state (its step count on the CPU)
    devices = [t.device for t in _tensors(model, opt)]
    state = TrainState(model=model, optimizer=opt, step=0)
    if rank == 0:
        _steps(model, opt, 4, seed=5)
        state.step = 4
        state.commit()
    t0 = time.perf_counter()
    state.sync(0)
    pair_s = time.perf_counter() - t0
    digest = _digest(_tensors(model, opt))
    digests: list = [None, None]
    dist.all_gather_object(digests, digest)
    group.release("done")
    group.destroy()
    out = {"pair_sync_s": pair_s, "pair_digests_equal": digests[0] == digests[1],
           "pair_step": state.step,
           "pair_on_device": [t.device for t in _tensors(model, opt)] == devices}
    if backend == "nccl":
        solo = ProcessGroup("nccl", timeout=timedelta(seconds=60), skip_ports=frozenset(),
                            form_timeout=timedelta(seconds=30), device_index=0)
        solo.form(dist.HashStore(), rank=0, world_size=1)
        _steps(model, opt, 1, seed=6)  # the live state moves away from the commit
        state.sync(0)
        out["solo_nccl_sync_restores_commit"] = _digest(_tensors(model, opt)) == digest
        solo.release("done")
        solo.destroy()
    results[rank] = out


def sync_checks(backend: str) -> dict:
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_sync_rank, args=(r, port, backend, results)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        found = dict(results)
    return {"exit_codes": codes, **{f"rank{r}": v for r, v in sorted(found.items())}}


def _failures(report: dict) -> list[str]:
    """The names of every boolean check that is False (``is_initialized_after`` must be)."""
    failed = []

    def visit(obj, path):
        if isinstance(obj, dict):
            for key, value in obj.items():
                if key == "rows":
                    continue
                if isinstance(value, bool):
                    good = not value if key == "is_initialized_after" else value
                    if not good:
                        failed.append(f"{path}{key}")
                else:
                    visit(value, f"{path}{key}.")
    visit(report, "")
    if "exit_codes" in report.get("sync", {}) and report["sync"]["exit_codes"] != [0, 0]:
        failed.append(f"sync.exit_codes={report['sync']['exit_codes']}")
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cycles", type=int, default=50)
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="gloo: the same checks on the CPU (a dry run of this script)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {','.join(PARTS)}")
    if args.backend == "nccl" and not torch.cuda.is_available():
        p.error("no GPU is visible: run with --backend gloo for a dry run on the CPU")
    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    report: dict = {}
    timings = {"versions": lambda: versions(),
               "cycles": lambda: cycles(args.cycles, args.backend),
               "release": lambda: release_breakdown(5, args.backend),
               "state": lambda: state_checks(device),
               "sync": lambda: sync_checks(args.backend)}
    for part in parts:
        t0 = time.perf_counter()
        try:
            report[part] = timings[part]()
        except Exception as exc:  # noqa: BLE001  (a check's failure is its result; go on)
            report[part] = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
        shown = report[part].get("summary", report[part])
        print(f"{part} ({time.perf_counter() - t0:.1f} s): {json.dumps(shown)}", flush=True)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    written = out / f"gpu-check-{'-'.join(parts)}.json"
    written.write_text(json.dumps(report, indent=1))
    failed = _failures(report)
    print(f"wrote {written}; " +
          (f"FAILED: {', '.join(failed)}" if failed else "every check passed"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
