"""The plain DDP loop of the benchmark, as a torchrun user writes it (restart-based recovery)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import workload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    p.add_argument("--size", choices=sorted(workload.SIZES), default="0.3m")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the model on this worker's GPU (LOCAL_RANK), NCCL")
    args = p.parse_args()
    workload.pin_to_core()
    device = workload.device(args.device)
    init_group(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    progress = workload.Progress(args.out, f"torchrun-{os.getpid()}")
    data = workload.dataset()
    model = workload.model(args.size).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = workload.optimizer(ddp.parameters(), args.optimizer)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            workload.train_step(ddp, opt, x, y)
            step += 1
            progress.step(step, rank, world, restart=os.environ.get("TORCHELASTIC_RESTART_COUNT"))
            if step >= args.steps:
                break
        epoch += 1
    dist.destroy_process_group()


def init_group(device: torch.device) -> None:
    """env:// as torchrun users write it, with a per-restart key prefix; NCCL on a GPU.

    Without the prefix, torch 2.13's torchrun (c10d and static rendezvous, gloo) restarts the
    workers against the agent's store that still holds the dead attempt's gloo addresses, and
    every restart fails in connectFullMesh ("Connection refused"); measured in this benchmark.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)
    if device_id is not None:
        torch.cuda.set_device(device_id)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, device_id=device_id)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{restart}/", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            device_id=device_id)


if __name__ == "__main__":
    main()
