"""The same loop as ``torchrun_worker.py`` under ``ElasticState.run`` (in-process recovery).

``--commit-part copy-free`` makes every step a copy-free commit (``commit_step``: the step
applied inside it); it needs ``--commit-every 1``, since a copy-free commit's live state is the
rollback point only while every step is agreed.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import DataLoader

import workload
from elastic import ElasticSampler, ElasticState
from elastic.state import TrainState


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--commit-part", choices=("both", "snapshot", "agreement", "copy-free"),
                   default="both",
                   help="what the periodic commit does: the whole commit() (default), only its "
                        "snapshot, only its membership agreement (check_membership), or "
                        "commit_step() around every step (copy-free)")
    p.add_argument("--size", choices=sorted(workload.SIZES), default="0.3m")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the model on this worker's GPU (NCCL, by the backend's auto)")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="DataLoader worker processes (num_workers) of each worker")
    p.add_argument("--persistent-loader", action="store_true",
                   help="one DataLoader for the whole run, made before ElasticState.run with "
                        "persistent_workers=True: its worker processes outlive re-formations")
    args = p.parse_args()
    if args.commit_part == "copy-free" and args.commit_every != 1:
        p.error(f"--commit-part copy-free commits every step; --commit-every "
                f"({args.commit_every}) must be 1.")
    workload.pin_to_core()
    data = workload.dataset()
    model = workload.model(args.size).to(workload.device(args.device))
    opt = workload.optimizer(model.parameters(), args.optimizer)
    state = ElasticState(model=model, optimizer=opt, sampler=ElasticSampler(data, seed=0),
                         epoch=0, step=0)
    progress = workload.Progress(args.out, f"elastic-{os.getpid()}")

    def commit() -> None:
        if args.commit_part == "snapshot":
            TrainState.commit(state)
        elif args.commit_part == "agreement":
            state.check_membership()
        else:
            state.commit()

    def make_loader() -> DataLoader:
        return DataLoader(data, batch_size=args.batch, sampler=state.sampler,
                          num_workers=args.loader_workers,
                          persistent_workers=args.persistent_loader and args.loader_workers > 0)

    kept = make_loader() if args.persistent_loader else None

    def train(s: ElasticState) -> None:
        ddp = s.ddp(s.model)
        loader = kept or make_loader()
        while s.step < args.steps:
            s.sampler.set_epoch(s.epoch)
            for x, y in loader:
                if args.commit_part == "copy-free":
                    workload.gradients(ddp, s.optimizer, x, y)
                    with s.commit_step():
                        s.optimizer.step()
                        s.sampler.record_batch(len(x))
                        s.step += 1
                        progress.step(s.step, s.rank, s.world_size, generation=s.generation)
                else:
                    workload.train_step(ddp, s.optimizer, x, y)
                    s.sampler.record_batch(len(x))
                    s.step += 1
                    progress.step(s.step, s.rank, s.world_size, generation=s.generation)
                    if s.step % args.commit_every == 0:
                        commit()
                if s.step >= args.steps:
                    return
            s.epoch += 1

    state.run(train)


if __name__ == "__main__":
    main()
