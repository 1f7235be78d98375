"""The path users have today, for ``bench_reshard.py``: DCP save at N ranks to local disk, then
a restarted job of M ranks that loads it (torch.multiprocessing, gloo, FSDP2, the same model).

Owns timing that path by phase, all against the parent's wall clock: the save at N (rank 0,
between barriers); the restart at M, as torchrun's restart pays it where it runs: fresh
processes started (spawn), torch imported, ``init_process_group``, the FSDP2 model and its
optimizer built (and the optimizer state initialised by ``get_state_dict``); then the DCP load.
A restart's detection and its first step are not counted (our side reports them apart).
Imported as ``reshard_anchor``.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict

import reshard_worker

WAIT_S = 900


def _rank(rank: int, world: int, folder: str, size: tuple[int, int, bool], mode: str,
          store: str, times) -> None:
    entered = time.time()  # the process started and imported torch and this module
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=WAIT_S))
    grouped = time.time()
    width, layers, meta = size
    # a restart that loads the checkpoint skips the initialisation, as the elastic side does
    model, opt = reshard_worker.parallelize(width, layers, meta=meta, init=mode == "save")
    if mode == "save":  # state worth saving: one real step
        model(torch.randn(2, width)).pow(2).mean().backward()
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": optim_sd}
    dist.barrier()
    built = time.time()
    if mode == "save":
        dcp.save(state, checkpoint_id=folder)
    else:
        dcp.load(state, checkpoint_id=folder)
    dist.barrier()
    if rank == 0:
        times[mode] = {"entered": entered, "grouped": grouped, "built": built,
                       "done": time.time()}
    dist.destroy_process_group()


def run(width: int, layers: int, before: int = 8, after: int = 6, meta: bool = True) -> dict:
    """DCP save at ``before`` ranks, then a restart of ``after`` ranks that loads it (``meta``:
    the model built as ``reshard_worker.parallelize`` says)."""
    with tempfile.TemporaryDirectory(prefix="reshard-dcp-") as tmp:
        times = mp.Manager().dict()
        started = {}
        for mode, world in (("save", before), ("load", after)):
            started[mode] = time.time()
            mp.start_processes(_rank, nprocs=world, start_method="spawn",
                               args=(world, f"{tmp}/ckpt", (width, layers, meta), mode,
                                     f"{tmp}/store-{mode}", times))
        size = sum(f.stat().st_size for f in Path(tmp, "ckpt").iterdir())
        save, load = times["save"], times["load"]
        restart = {
            "restart_process_import_s": load["entered"] - started["load"],
            "restart_init_process_group_s": load["grouped"] - load["entered"],
            "restart_build_model_s": load["built"] - load["grouped"],
        }
        restart_s = load["built"] - started["load"]
        save_s, load_s = save["done"] - save["built"], load["done"] - load["built"]
        return {
            f"dcp_save_at_{before}_s": save_s,
            **restart,
            f"restart_at_{after}_s": restart_s,
            f"dcp_load_at_{after}_s": load_s,
            "dcp_total_s": save_s + load_s,
            "dcp_through_disk_s": save_s + restart_s + load_s,
            "dcp_bytes": size,
        }
