"""A test job for the rollback matrix (issue 39): one real loop shape, killed at named points.

``--loop`` picks the shape (tests/workers/loop_kinds.py: AMP, accumulation, zero_grad after the
step, an LR warmup, BatchNorm and dropout, a GAN-shaped step, an EMA copy, a compiled model).
Constant global batch, world 2 throughout: a worker that finds itself in a smaller world
holds until a joiner (a waiting spare) is in, so every step trains in the reference's world and
the end state must match an uninterrupted run bit for bit. ``--copy-free`` commits every step
with ``commit_step()``; otherwise ``commit()`` every ``--commit-every`` steps and at epoch ends.
Every agreed step's sample indices go into a committed ledger.

``FAULTS="kill:r0:3:backward,kill:r1:8:agree"`` SIGKILLs whichever worker holds rank N when it
reaches that point of that step, once each (marker ``fired-{n}``, n the fault's position).
The points of a step, in order: ``forward`` (before the forward), ``backward`` (inside the
backward, before any parameter's gradient: the peers wait in the all-reduce), ``micro``
(between the second and third accumulated micro-batches), ``agree`` (after the backward,
before the step's last collective and the agreement), ``block`` (inside the ``commit_step()``
block, or before the snapshot commit, right after ``optimizer.step()``), ``after`` (just after
the block).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from elastic import ElasticSampler, ElasticState, MembershipChangedInterrupt
from elastic.state import seed_everything
from tests.workers.global_batch import Regression
from tests.workers.loop_kinds import LOOPS
from tests.workers.markers import write_marker
from tests.workers.sync_points import hold_until_world, wait_for_peers

WORLD = 2


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--loop", choices=sorted(LOOPS), required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--commit-every", type=int, default=3)
    p.add_argument("--copy-free", action="store_true", help="commit every step with commit_step")
    return p.parse_args()


class Faults:
    """The planned kills of ``FAULTS``, each fired once job-wide (its marker says so)."""

    def __init__(self, out: Path, index: int) -> None:
        self.out = out
        self.index = index
        self.plan = [spec.split(":") for spec in
                     filter(None, os.environ.get("FAULTS", "").split(","))]

    def fire(self, state: ElasticState, where: str) -> None:
        step = state.step + 1  # the step being trained
        for n, (kind, who, at, place) in enumerate(self.plan):
            marker = self.out / f"fired-{n}"
            if (kind != "kill" or who != f"r{state.rank}" or int(at) != step or place != where
                    or marker.exists()):
                continue
            write_marker(marker, {"index": self.index, "rank": state.rank, "step": step,
                                  "where": where, "world": state.world_size, "t": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # the harness dumps every thread's stack on a hang
    args = parse()
    out = Path(args.out)
    index = int(os.environ["TEST_WORKER_INDEX"])
    seed_everything(1)
    loop = LOOPS[args.loop]()
    dataset = Regression(args.samples, augment=False)
    sampler = ElasticSampler(dataset, seed=7, global_batch_size=args.global_batch)
    state = ElasticState(sampler=sampler, epoch=0, step=0,
                         ledger=[[] for _ in range(args.epochs)], **loop.objects())
    faults = Faults(out, index)
    finished: list[bool] = []  # this process ran the last step
    progress = open(out / f"progress-{index}.jsonl", "a", buffering=1)

    def step(s: ElasticState, batch) -> None:
        fire = lambda where: faults.fire(s, where)  # noqa: E731
        fire("forward")
        loop.gradients(batch, s.sampler.share().loss_scale, fire)
        fire("agree")
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, batch[2].tolist())
        try:
            with s.commit_step() if args.copy_free else contextlib.nullcontext():
                loop.update(fire)
                s.sampler.record_batch(len(batch[2]))
                s.step += 1
                s.ledger[s.epoch].extend(i for part in everyone for i in part)
                progress.write(json.dumps({"step": s.step, "world": s.world_size}) + "\n")
        except MembershipChangedInterrupt:
            # The step was applied and the block hands over to a re-formation (a spare's
            # join seen at this step): still "just after the block" for this step's kill.
            fire("after")
            raise
        fire("after")

    def train(s: ElasticState) -> None:
        if s.world_size < WORLD:
            hold_until_world(s, WORLD)
        loop.wrap(s)
        # Own generator: iter(loader) would otherwise draw from the committed global RNG at
        # every re-entry, and dropout would draw other masks than the uninterrupted run's.
        loader = DataLoader(dataset, batch_sampler=s.sampler,
                            generator=torch.Generator().manual_seed(0))
        while s.epoch < args.epochs:
            s.sampler.set_epoch(s.epoch)
            for batch in loader:
                step(s, batch)
                if not args.copy_free and s.step % args.commit_every == 0:
                    s.commit()
            s.epoch += 1
            if not args.copy_free:
                s.commit()
        finished.append(True)

    wait_for_peers(out, index)
    state.run(train)
    flat = torch.cat([t.detach().double().flatten() for t in loop.compared()])
    (out / f"result-{index}.json").write_text(json.dumps({
        "trained": bool(finished), "state": flat.tolist(), "ledger": state.ledger,
        "step": state.step}))


if __name__ == "__main__":
    main()
