"""What forming one gloo group of N ranks through the round store costs etcd.

Usage: ``.venv/bin/python benchmarks/bench_round_store.py [--sizes 4,16,32] [--out PATH]``.

N ranks are threads of this process, each forming its own ``ProcessGroupGloo`` (a real gloo
full mesh over loopback) and running one all-reduce through ``RoundStore`` (rank 0 hosts a
TCPStore on 127.0.0.1, etcd holds its address). The etcd-backed store it replaced (every key of
the formation in etcd) was measured the same way before its removal: ``benchmarks/RESULTS.md``.

Counted in the (shared) etcd client: requests, writes and watch events delivered; and the keys
left under the round's prefix. Times are from the first rank's start to the last all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.membership_sim import CountingClient  # noqa: E402
from elastic.cluster.rounds.keys import JobKeys  # noqa: E402
from elastic.cluster.links.round_store import RoundStore, StoreTimes  # noqa: E402
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402

WAIT = timedelta(seconds=60)
TIMES = StoreTimes(WAIT, timedelta(seconds=1), timedelta(seconds=0.05))


def form(client: CountingClient, world: int, job: str) -> dict:
    keys = JobKeys(job)

    def rank_main(rank: int) -> float:
        store = RoundStore(client, keys.store_address(1), rank, "127.0.0.1", TIMES)
        store.connect()
        options = dist.ProcessGroupGloo._Options()
        options._timeout = WAIT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(store, rank, world, options)
        tensor = torch.ones(1)
        group.allreduce([tensor]).wait()
        store.close()
        return tensor.item()

    before = dict(client.counts)
    started = time.monotonic()
    with ThreadPoolExecutor(world) as pool:
        sums = list(pool.map(rank_main, range(world), timeout=300))
    seconds = time.monotonic() - started
    assert sums == [float(world)] * world
    counts = {k: v - before.get(k, 0) for k, v in client.counts.items()}
    kvs, _ = client.get_prefix(keys.round_prefix(1))
    return {"store": "round", "n": world, "seconds": round(seconds, 3),
            "etcd_requests": counts.get("read", 0) + counts.get("write", 0) - 1,  # less ours
            "etcd_writes": counts.get("write", 0), "watch_events": counts.get("watch_events", 0),
            "etcd_keys": len(kvs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="4,16,32")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    etcd = EmbeddedEtcd(niceness=0, go_max_procs=None).start()
    client = CountingClient(etcd.url)
    results = []
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            result = form(client, n, f"store-round-{n}")
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        client.close()
        etcd.stop()
    if args.out:
        Path(args.out).write_text(json.dumps({"cores": os.cpu_count(), "date": time.strftime(
            "%Y-%m-%d"), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
