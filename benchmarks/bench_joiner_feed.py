"""How fast a joiner is fed the job's state, against the loopback link measured in the same run.

Usage: ``.venv/bin/python benchmarks/bench_joiner_feed.py [--params 100m] [--small] [--reps 2]
[--caps 64,256] [--out PATH]`` (``python -m benchmarks joiner-feed``).

Per rep, in this order: (1) the link: a plain TCP socket pair on 127.0.0.1, one process sending
the payload's size in 64 MiB writes to another that receives into a preallocated buffer; (2)
the state transfer, once per bucket cap: three processes in a gloo group on loopback (rank 0
the source, rank 1 a running worker, rank 2 the joiner) run ``broadcast_payload``, the code a
re-formation uses (``state.sync``), for each bucket cap and number of buckets in flight, on a model of ``--params`` parameters with Adam's state
(parameters + two moments: 12 bytes a parameter, 1.2 GB at 100M). Reported: the joiner's
bytes/s and its ratio to the link's, and the running worker's pause (its time inside the
transfer) against one bucket's transfer time. Targets (issue 45): ratio >= 0.5; pause <= one
bucket. ``--small`` (10M parameters) runs under load; the claim is the 100M run on an idle
machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHUNK = 64 * 1024 * 1024


def _send(port: int, nbytes: int) -> None:
    data = bytes(CHUNK)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        sent = 0
        while sent < nbytes:
            view = memoryview(data)[:min(CHUNK, nbytes - sent)]
            conn.sendall(view)
            sent += len(view)


def link_bytes_per_s(nbytes: int) -> float:
    """Loopback TCP: one process sends ``nbytes`` to this one; bytes per second received."""
    buffer = bytearray(nbytes)
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = mp.get_context("spawn").Process(target=_send,
                                                 args=(server.getsockname()[1], nbytes))
        sender.start()
        conn, _ = server.accept()
        with conn:
            view, got = memoryview(buffer), 0
            started = time.perf_counter()
            while got < nbytes:
                n = conn.recv_into(view[got:], min(CHUNK, nbytes - got))
                if not n:
                    raise RuntimeError(f"the sender stopped after {got} of {nbytes} bytes")
                got += n
            took = time.perf_counter() - started
        sender.join(60)
    return nbytes / took


def _payload(params: int) -> dict:
    """A model of ``params`` parameters (square Linear layers) with Adam's state after a step."""
    import torch  # noqa: PLC0415 (in the ranks only)
    width = 2048
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)))
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _rank(rank: int, port: int, params: int, variants: list[tuple[int, int]],
          results: mp.Queue) -> None:
    import torch.distributed as dist  # noqa: PLC0415
    sys.path.insert(0, str(REPO))
    from elastic.state import sync  # noqa: PLC0415
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3, timeout=datetime.timedelta(minutes=10))
    payload = _payload(params) if rank < 2 else None  # the joiner holds nothing
    for cap, in_flight in variants:
        sync.IN_FLIGHT = in_flight
        dist.barrier()
        started = time.perf_counter()
        got = sync.broadcast_payload(payload if rank == 0 else None, 0, cap_bytes=cap)
        took = time.perf_counter() - started
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(got))
        results.put({"rank": rank, "variant": _name(cap, in_flight), "s": took,
                     "bytes": nbytes})
        del got
    dist.destroy_process_group()


def _tensors(value: object) -> list:
    import torch  # noqa: PLC0415
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _name(cap: int, in_flight: int) -> str:
    return f"{cap >> 20} MiB, {in_flight} in flight"


def transfer(params: int, variants: list[tuple[int, int]]) -> list[dict]:
    """One broadcast per variant (bucket cap, buckets in flight) among three ranks; every rank's
    figures."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    ranks = [ctx.Process(target=_rank, args=(r, port, params, variants, results))
             for r in range(3)]
    for proc in ranks:
        proc.start()
    figures = [results.get(timeout=1800) for _ in range(3 * len(variants))]
    for proc in ranks:
        proc.join(120)
    return figures


def _parse_count(raw: str) -> int:
    raw = raw.lower()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(raw[-1], 1)
    return int(float(raw.rstrip("kmg")) * scale)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="100m", help="model parameters (100m: 1.2 GB with Adam)")
    p.add_argument("--small", action="store_true", help="10M parameters: runs under load")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--caps", default="64,256", help="bucket caps to compare, MiB")
    p.add_argument("--in-flight", default="0,1",
                   help="buckets in flight beyond the one waited for, to compare (state.sync "
                        "IN_FLIGHT; 0: one bucket at a time, as before)")
    p.add_argument("--out", default=str(REPO / "runs" / "joiner-feed.json"))
    args = p.parse_args()
    params = 10**7 if args.small else _parse_count(args.params)
    variants = [(int(c) * 1024 * 1024, int(n)) for c in args.caps.split(",")
                for n in args.in_flight.split(",")]
    reps = []
    for rep in range(args.reps):
        figures = transfer(params, variants if rep % 2 == 0 else variants[::-1])
        nbytes = next(f["bytes"] for f in figures if f["rank"] == 2)
        link = link_bytes_per_s(nbytes)
        row = {"bytes": nbytes, "link_bytes_per_s": link, "variants": {}}
        for cap, in_flight in variants:
            name = _name(cap, in_flight)
            joiner = next(f for f in figures if f["rank"] == 2 and f["variant"] == name)
            running = next(f for f in figures if f["rank"] == 1 and f["variant"] == name)
            buckets = max(1, -(-nbytes // cap))
            row["variants"][name] = {
                "joiner_bytes_per_s": nbytes / joiner["s"], "ratio": nbytes / joiner["s"] / link,
                "transfer_s": joiner["s"], "running_pause_s": running["s"],
                "one_bucket_s": joiner["s"] / buckets, "buckets": buckets}
        reps.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'variant':>24}{'joiner GB/s':>13}{'link GB/s':>11}{'ratio':>7}"
          f"{'pause s':>9}{'1 bucket s':>12}")
    for cap, in_flight in variants:
        key = _name(cap, in_flight)
        rows = [r["variants"][key] for r in reps]
        print(f"{key:>24}{statistics.median(r['joiner_bytes_per_s'] for r in rows) / 1e9:>13.2f}"
              f"{statistics.median(r['link_bytes_per_s'] for r in reps) / 1e9:>11.2f}"
              f"{statistics.median(r['ratio'] for r in rows):>7.2f}"
              f"{statistics.median(r['running_pause_s'] for r in rows):>9.2f}"
              f"{statistics.median(r['one_bucket_s'] for r in rows):>12.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cores": os.cpu_count(), "params": params,
                                          "reps": reps}, indent=1))


if __name__ == "__main__":
    main()
