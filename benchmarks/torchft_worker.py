"""The benchmark's loop under torchft (an optional anchor: ``pip install -e '.[bench-torchft]'``).

torchft's documented DDP usage (its README and ``train_ddp.py``): one process per replica group
(here a group of one), a ``Manager`` on a ``ProcessGroupGloo`` with a lighthouse, the model in
``torchft.DistributedDataParallel``, the optimizer in ``torchft.Optimizer`` (``zero_grad``
starts the quorum, ``step`` steps only when ``should_commit`` agrees), live recovery from a
healthy peer over the process group (``PGTransport``) and torchft's ``DistributedSampler``. The
replica group's TCPStore, which torchrun would start, is started here.

``--grads manager`` averages the gradients with ``Manager.allreduce`` itself (all of them
flattened into one tensor: one bucket) instead of ``torchft.DistributedDataParallel``: in
torchft 0.2.0 that DDP kills a survivor when a peer dies while the gradients fill more than one
bucket (the bucket after the failed one gets a ``_DummyWork``, whose future fails the hook's
``assert fut._fut``: pytorch/torchft PR 294, issue 304; seen here with this 2-bucket model).
The recovery benchmark uses ``manager``, the throughput comparison torchft's DDP.

Writes one progress line (``workload.Progress``) per committed step: the manager's step, this
replica group's index as ``rank`` and the quorum's participants as ``world``; and, once its
manager is up (imports and setup done), the time in ``ready-{pid}``. ``--low`` sets
the lowest timeouts its documentation shows: the process group's 5 s and the manager's 30 s of
``train_ddp.py`` (the lighthouse's are set by the benchmark that starts it).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import TCPStore
from torch.utils.data import DataLoader
from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, \
    ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

import workload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--lighthouse", required=True, help="http://127.0.0.1:PORT")
    p.add_argument("--replica", type=int, required=True, help="this replica group's index")
    p.add_argument("--replicas", type=int, required=True, help="replica groups of the job")
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--batch", type=int, default=32, help="samples per replica and step")
    p.add_argument("--size", choices=sorted(workload.SIZES), default="0.3m")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--low", action="store_true", help="train_ddp.py's timeouts (5 s, 30 s)")
    p.add_argument("--grads", choices=("ddp", "manager"), default="ddp",
                   help="torchft's DDP, or one Manager.allreduce of all the gradients")
    args = p.parse_args()
    workload.pin_to_core()
    progress = workload.Progress(args.out, f"torchft-{os.getpid()}")
    data = workload.dataset()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5)) if args.low else ProcessGroupGloo()
    model = workload.model(args.size)
    opt_box: list[torch.optim.Optimizer] = []

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt_box[0].state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt_box[0].load_state_dict(state["optim"])

    timeouts = {"timeout": timedelta(seconds=30)} if args.low else {}
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"bench_{args.replica}",
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, hostname="127.0.0.1",
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10),
                                                       device=torch.device("cpu")),
                      **timeouts)
    # When the replica group is ready to join: the benchmark times the rejoin and heal from here.
    (Path(args.out) / f"ready-{os.getpid()}").write_text(repr(time.time()))
    ddp = DistributedDataParallel(manager, model) if args.grads == "ddp" else model
    opt = Optimizer(manager, workload.optimizer(ddp.parameters(), args.optimizer))
    opt_box.append(opt)
    sampler = DistributedSampler(data, replica_rank=args.replica,
                                 num_replica_groups=args.replicas, group_rank=0, num_replicas=1,
                                 shuffle=True)
    committed, epoch = manager.current_step(), 0
    while committed < args.steps:
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=args.batch, sampler=sampler):
            opt.zero_grad()  # starts the quorum
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            if args.grads == "manager":
                average(manager, model)
            opt.step()  # steps only when should_commit agrees
            if manager.current_step() > committed:
                committed = manager.current_step()
                progress.step(committed, args.replica, manager.num_participants())
            if committed >= args.steps:
                break
        epoch += 1
    manager.shutdown()


def average(manager: Manager, model: torch.nn.Module) -> None:
    """The gradients averaged over the quorum in one ``Manager.allreduce`` (a failure makes
    it a no-op that ``should_commit`` then refuses)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


if __name__ == "__main__":
    main()
