"""A test job for issue 5: constant global batch (or per-worker batch) under ElasticState.run.

float64 two-layer regression. In ``--mode global`` each global step trains the same samples
whatever the world size, the summed loss is weighted by ``share().loss_scale``, dropout masks
are seeded per sample from a base drawn each step from the committed RNG, and augmentation
runs in ``SeededDataset``. The global loss of every step goes into a committed ``history``, so
rolled-back steps drop out. ``--hold-at 4,16`` makes the group wait at those (commit) steps
until joiners bring the world to 3 (so a slow start or a join cannot miss its step); ``FAULTS`` fire as in ``train.py``. In
``--mode per-worker`` the LR follows ``LinearLRScaling`` and every reset logs it. With
``--copy-free`` every step is a copy-free commit (``commit_step``) and no snapshot commit is
taken; a fault may then name where in the step it fires (``kill:2:10:before``: after the
step's last collective and before the agreement; ``during``: inside the agreed block, before
``optimizer.step()``; ``after``, the default: after the step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from tests.workers.markers import write_marker
from tests.workers.sync_points import wait_for_peers
from elastic import ElasticSampler, ElasticState
from elastic.state import LinearLRScaling, RNGState, SeededDataset, seed_everything

HIDDEN = 16


class Regression(Dataset):
    def __init__(self, n: int, augment: bool) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g, dtype=torch.float64)
        w = torch.arange(1, 9, dtype=torch.float64) / 8
        self.y = torch.tanh(self.x @ w) + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.augment:  # all three generators, as augmentation code would use them
            x = x + 0.01 * torch.randn(8, dtype=torch.float64) \
                + 0.01 * torch.from_numpy(np.random.randn(8)) + 0.01 * random.gauss(0, 1)
        return x, self.y[i], i


class Net(torch.nn.Module):
    """Linear-tanh-dropout-linear; the dropout mask of each sample comes from its own seed."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, HIDDEN, dtype=torch.float64)
        self.fc2 = torch.nn.Linear(HIDDEN, 1, dtype=torch.float64)
        self.p = dropout

    def forward(self, x: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.p and self.training:
            keep = torch.stack([torch.rand(HIDDEN, dtype=torch.float64,
                                           generator=torch.Generator().manual_seed(int(s)))
                                for s in seeds.tolist()]) >= self.p
            h = h * keep / (1 - self.p)
        return self.fc2(h).squeeze(1)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["global", "per-worker"], default="global")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=194)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--commit-every", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--hold-at", default="", help="comma-separated commit steps")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--copy-free", action="store_true", help="commit every step with commit_step")
    return p.parse_args()


def fire_faults(state: ElasticState, out: Path, index: int, step: int | None = None,
                where: str = "after") -> None:
    step = state.step if step is None else step
    for spec in filter(None, os.environ.get("FAULTS", "").split(",")):
        kind, who, at, *place = spec.split(":")
        marker = out / f"fired-{kind}-{index}"
        if (int(who) != index or int(at) != step or (place or ["after"])[0] != where
                or marker.exists()):
            continue
        write_marker(marker, {"step": step, "rank": state.rank, "where": where,
                              "world": state.world_size, "t": time.time()})
        os.kill(os.getpid(), {"kill": signal.SIGKILL, "term": signal.SIGTERM}[kind])


def draw_base_seed() -> int:
    """One base seed per step from the committed generators (torch, numpy, python)."""
    return (int(torch.randint(0, 2**62, (1,)).item()) ^ int(np.random.randint(0, 2**31))
            ^ random.getrandbits(62))


def hold_for_join(s: ElasticState, args: argparse.Namespace) -> None:
    """At a ``--hold-at`` step, keeps agreeing on membership until the world is 3."""
    if str(s.step) not in args.hold_at.split(",") or s.world_size >= 3:
        return
    deadline = time.monotonic() + 60
    pace = threading.Event()
    while time.monotonic() < deadline:
        s.check_membership()  # raises MembershipChangedInterrupt once the joiner is in
        pace.wait(0.05)
    raise TimeoutError(f"no worker joined at step {s.step} within 60 s")


def global_step(s: ElasticState, ddp: DDP, batch, args) -> float:
    """One constant-global-batch step; returns the mean loss over the global batch."""
    x, _, _ = batch
    loss = global_gradients(s, ddp, batch, args)
    s.optimizer.step()
    s.sampler.record_batch(len(x))
    return loss


def global_gradients(s: ElasticState, ddp: DDP, batch, args) -> float:
    """A constant-global-batch step up to its update: the reduced gradients, and the mean loss
    over the global batch (both of the step's collectives are done when it returns)."""
    x, y, _ = batch
    share = s.sampler.share()
    base = draw_base_seed() if args.dropout else 0
    pred = ddp(x, torch.tensor(share.seeds(base % 2**62, s.epoch), dtype=torch.int64))
    squared = (pred - y) ** 2
    loss = squared.sum() * share.loss_scale
    s.optimizer.zero_grad()
    loss.backward()
    total = squared.detach().sum() if share.size else torch.zeros((), dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / share.total


def copy_free_step(s: ElasticState, ddp: DDP, batch, args, fire, report) -> None:
    """A constant-global-batch step committed by ``commit_step``, faults fired around it. The
    block is the step's last part: after it, a change agreed at it hands over to the run loop."""
    x, _, _ = batch
    loss = global_gradients(s, ddp, batch, args)
    fire(s.step + 1, "before")
    with s.commit_step():
        fire(s.step + 1, "during")
        s.optimizer.step()
        s.sampler.record_batch(len(x))
        s.step += 1
        s.history.append(loss)
        report(loss)


def per_worker_step(s: ElasticState, ddp: DDP, batch, args) -> float:
    x, y, _ = batch
    loss = torch.nn.functional.mse_loss(ddp(x, torch.zeros(len(x), dtype=torch.int64)), y)
    s.optimizer.zero_grad()
    loss.backward()
    s.optimizer.step()
    s.sampler.record_batch(len(x))
    return loss.item()


def make_loader(s: ElasticState, dataset: Dataset, args) -> DataLoader:
    # Own generator: iter(loader) would otherwise draw from the committed global RNG.
    common = dict(num_workers=args.loader_workers, generator=torch.Generator().manual_seed(0))
    if args.mode == "global":
        return DataLoader(dataset, batch_sampler=s.sampler, **common)
    return DataLoader(dataset, batch_size=args.batch, sampler=s.sampler, **common)


def main() -> None:
    args = parse()
    out = Path(args.out)
    index = int(os.environ["TEST_WORKER_INDEX"])
    seed_everything(1)  # numpy and random start from OS entropy otherwise
    model = Net(args.dropout)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    raw = Regression(args.samples, augment=args.loader_workers > 0)
    if args.mode == "global":
        sampler = ElasticSampler(raw, seed=7, global_batch_size=args.global_batch)
    else:
        sampler = ElasticSampler(raw, seed=7, batch_size=args.batch)
    dataset = SeededDataset(raw, sampler)
    state = ElasticState(model=model, optimizer=opt, sampler=sampler, rng=RNGState(),
                         epoch=0, step=0, history=[])
    progress = open(out / f"progress-{index}.jsonl", "a", buffering=1)
    if args.mode == "per-worker":
        state.on_reset(LinearLRScaling(opt, base_lr=args.lr, base_world_size=2))
    state.on_reset(lambda s: progress.write(json.dumps({
        "event": "reset", "world": s.world_size, "step": s.step,
        "lr": s.optimizer.param_groups[0]["lr"]}) + "\n"))
    step_fn = global_step if args.mode == "global" else per_worker_step

    def report(loss: float) -> None:
        progress.write(json.dumps({"step": state.step, "world": state.world_size, "loss": loss,
                                   "lr": opt.param_groups[0]["lr"]}) + "\n")

    def train(s: ElasticState) -> None:
        ddp = DDP(s.model)
        loader = make_loader(s, dataset, args)
        while s.epoch < args.epochs:
            s.sampler.set_epoch(s.epoch)
            for batch in loader:
                if args.copy_free:
                    copy_free_step(s, ddp, batch, args, lambda step, where: fire_faults(
                        s, out, index, step, where), report)
                else:
                    loss = step_fn(s, ddp, batch, args)
                    s.step += 1
                    s.history.append(loss)
                    report(loss)
                fire_faults(s, out, index)
                if s.step % args.commit_every == 0:
                    if not args.copy_free:
                        s.commit()
                    hold_for_join(s, args)
            s.epoch += 1
            if not args.copy_free:  # the next agreed step records the new epoch
                s.commit()

    wait_for_peers(out, index)
    state.run(train)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    (out / f"result-{index}.json").write_text(json.dumps({
        "params": flat.tolist(), "history": state.history, "step": state.step}))


if __name__ == "__main__":
    main()
