"""The plain side of ``bench_reshard.py --steady``: the same FSDP2 loop as ``reshard_worker.py``
without the library (torch.multiprocessing, gloo, no commits, no buddy copies), and the
throughput both sides are compared by.

Owns the plain loop (the same model, AdamW, global batch, data and per-rank share of it, one
time per step on rank 0) and ``throughput``: steps per second between a warm-up step and the
last (a whole number of commit intervals, so the elastic side pays its commits' share).
Imported as ``reshard_steady``.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reshard_worker

WAIT_S = 900


def _rank(rank: int, world: int, size: tuple[int, int, bool], steps: int, global_batch: int,
          store: str, times) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=WAIT_S))
    width, layers, meta = size
    model, optimizer = reshard_worker.parallelize(width, layers, meta=meta)
    data = reshard_worker.dataset(width).tensors[0]
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    share = global_batch // world
    stamps = []
    for step in range(steps):
        first = (step * global_batch) % (len(data) - global_batch) + rank * share
        x = data[order[first: first + share]]
        (model(x).pow(2).mean() * (share / global_batch)).backward()
        optimizer.step()
        optimizer.zero_grad()
        stamps.append(time.time())
    if rank == 0:
        times["plain"] = stamps
    dist.destroy_process_group()


def plain_run(width: int, layers: int, world: int, steps: int, global_batch: int,
              meta: bool = True) -> list[float]:
    """One run of the plain loop; rank 0's wall time at the end of every step."""
    with tempfile.TemporaryDirectory(prefix="reshard-plain-") as tmp:
        times = mp.Manager().dict()
        mp.start_processes(_rank, nprocs=world, start_method="spawn",
                           args=(world, (width, layers, meta), steps, global_batch,
                                 f"{tmp}/store", times))
        return list(times["plain"])


def throughput(stamps: list[float], warm: int) -> float:
    """Steps per second from the end of step ``warm`` to the end of the last step."""
    if len(stamps) <= warm:
        raise ValueError(f"{len(stamps)} steps are too few to skip {warm} warm-up steps.")
    return (len(stamps) - warm) / (stamps[-1] - stamps[warm - 1])
