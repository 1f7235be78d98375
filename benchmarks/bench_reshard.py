"""In-memory N -> M resharding of an FSDP2 job against DCP through disk, in one run.

Usage: ``.venv/bin/python benchmarks/bench_reshard.py [--small] [--out PATH]``.

Ours: one embedded etcd and 8 workers (``reshard_worker.py``: ~101M parameters, AdamW, gloo on
loopback, a commit every 10 steps, ``buddies=1``). Past step 12 the ranks 1 and 4 (not each
other's buddies: the ring is r -> r+1) are SIGKILLed; the 6 survivors reshard in memory and go
on; then 2 workers join and the job goes back to 8 (each rank's ``resharded`` event holds the
whole plan: the figures are one event's, not a sum). Reported: SIGKILL -> first step completed at
6; the reshard phase alone (the ``resharded`` events); the join pause (the longest step interval
of a survivor around the join); bytes moved against the minimum; resident memory per rank at 8
with buddy copies, and in a short run of the same job with ``--buddies 0``.

Anchor, the path users have today (same model, same machine, same run): DCP save at 8 ranks to
local disk, then DCP load at 6 ranks (torch.multiprocessing, gloo, FSDP2), both timed on rank 0
between barriers. ``--small`` shrinks the model (~2M parameters) so that it runs on a loaded
machine; the figures of the claim come from the default size on an idle one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import reshard_worker  # noqa: E402
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402

WORKER = str(HERE / "reshard_worker.py")
WAIT_S = 900


def _events_after(out: Path, t: float, name: str) -> list[dict]:
    rows = []
    for path in sorted((out / "events").glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line]
    return [r for r in rows if r["event"] == name and r["t"] > t]


def _latest_pids(out: Path, world: int) -> dict[int, int]:
    """rank -> pid of the newest progress lines in a world of ``world``."""
    ranks: dict[int, int] = {}
    for p in harness.read_progress(out):
        if p["world"] == world:
            ranks[p["rank"]] = p["pid"]
    return ranks


def run_ours(size: list[str], buddies: int, steps: int | None) -> dict:
    """The kill-2-then-join-2 job (``steps`` None), or a plain run of ``steps`` steps at 8."""
    out = Path(tempfile.mkdtemp(prefix="reshard-"))
    procs = harness.Procs(out)
    etcd = EmbeddedEtcd().start()
    try:
        env = harness.env_for(ELASTIC_ETCD=etcd.url, ELASTIC_JOB_ID=f"reshard-{buddies}",
                         ELASTIC_LEASE_TTL="5", ELASTIC_LOG_DIR=str(out / "events"),
                         ELASTIC_MIN_WORKERS="6")
        command = [sys.executable, WORKER, "--out", str(out), "--buddies", str(buddies), *size]
        if steps is not None:
            command += ["--steps", str(steps)]
        for _ in range(8):
            procs.start(command, env)
        harness.wait_for(lambda: harness.steps_of(out, 12, 8), WAIT_S, "8 workers at step 12")
        rss_at_8 = max(p["rss_mb"] for p in harness.read_progress(out) if p["world"] == 8)
        if steps is not None:
            return {"rss_mb_max_at_8": rss_at_8}
        ranks = _latest_pids(out, 8)
        killed_at = time.time()
        for rank in (1, 4):
            os.kill(ranks[rank], signal.SIGKILL)
        first6 = harness.wait_for(lambda: next((p for p in harness.read_progress(out)
                                           if p["t"] > killed_at and p["world"] == 6), None),
                             WAIT_S, "a step at world 6")
        harness.wait_for(lambda: harness.steps_of(out, first6["step"] + 12, 6), WAIT_S,
                         "12 steps at 6")
        shrink = _events_after(out, killed_at, "resharded")
        joined_at = time.time()
        for _ in range(2):
            procs.start(command, env)
        first8 = harness.wait_for(lambda: next((p for p in harness.read_progress(out)
                                           if p["t"] > joined_at and p["world"] == 8), None),
                             WAIT_S, "a step back at world 8")
        grow = [e for e in _events_after(out, joined_at, "resharded") if e["to_world"] == 8]
        survivor = first6["pid"]
        times = [p["t"] for p in harness.read_progress(out) if p["pid"] == survivor]
        gaps = [b - a for a, b in zip(times, times[1:]) if b > joined_at - 1]
        steady = [b - a for a, b in zip(times, times[1:]) if a < killed_at]
        return {
            "kill_to_first_step_at_6_s": first6["t"] - killed_at,
            "reshard_8_to_6_s": max(e["reshard_s"] for e in shrink),
            "bytes_moved_8_to_6": max((e["bytes_moved"] for e in shrink), default=0),
            "bytes_minimum_8_to_6": max((e["bytes_minimum"] for e in shrink), default=0),
            "join_pause_s": max(gaps) if gaps else None,
            "join_to_first_step_at_8_s": first8["t"] - joined_at,
            "reshard_6_to_8_s": max((e["reshard_s"] for e in grow), default=None),
            "bytes_moved_6_to_8": max((e["bytes_moved"] for e in grow), default=0),
            "bytes_minimum_6_to_8": max((e["bytes_minimum"] for e in grow), default=0),
            "steady_step_s": statistics.median(steady) if steady else None,
            "rss_mb_max_at_8": rss_at_8,
        }
    finally:
        procs.kill_all()
        etcd.stop()


def _dcp_rank(rank: int, world: int, folder: str, width: int, layers: int, mode: str,
              store: str, times) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=WAIT_S))
    model = reshard_worker.build(width, layers)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).pow(2).mean().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": optim_sd}
    dist.barrier()
    started = time.perf_counter()
    if mode == "save":
        dcp.save(state, checkpoint_id=folder)
    else:
        dcp.load(state, checkpoint_id=folder)
    dist.barrier()
    if rank == 0:
        times[mode] = time.perf_counter() - started
    dist.destroy_process_group()


def run_dcp_anchor(width: int, layers: int) -> dict:
    """DCP save at 8 ranks to local disk, then DCP load at 6: the restart path of today."""
    with tempfile.TemporaryDirectory(prefix="reshard-dcp-") as tmp:
        times = mp.Manager().dict()
        for mode, world in (("save", 8), ("load", 6)):
            mp.start_processes(_dcp_rank, nprocs=world, start_method="spawn",
                               args=(world, f"{tmp}/ckpt", width, layers, mode,
                                     f"{tmp}/store-{mode}", times))
        size = sum(f.stat().st_size for f in Path(tmp, "ckpt").iterdir())
        return {"dcp_save_at_8_s": times["save"], "dcp_load_at_6_s": times["load"],
                "dcp_total_s": times["save"] + times["load"], "dcp_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--small", action="store_true", help="~2M parameters (a loaded machine)")
    parser.add_argument("--out", type=Path, default=HERE / "runs" / "reshard.json")
    args = parser.parse_args()
    width, layers = (400, 12) if args.small else (2900, 12)
    size = ["--width", str(width), "--layers", str(layers)]
    params = layers * (width * width + width)
    print(f"model: {params / 1e6:.1f}M parameters, {3 * params * 4 / 2**20:.0f} MiB with AdamW",
          flush=True)
    result = {"params": params, "small": args.small, **run_ours(size, 1, None)}
    print(json.dumps(result), flush=True)
    result["rss_mb_max_at_8_without_buddies"] = run_ours(size, 0, 14)["rss_mb_max_at_8"]
    result.update(run_dcp_anchor(width, layers))
    for key, value in result.items():
        print(f"{key:>34}: {value:.3f}" if isinstance(value, float) else f"{key:>34}: {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
