"""A real training job for the tests: float64 linear regression under ElasticState.run.

Every batch's sample indices go into a committed ledger (so rolled-back batches drop out with
the rollback), progress goes to ``progress-{index}.jsonl``, the final parameters and ledger to
``result-{index}.json``. Faults fire inside the worker at a global step, once
(``FAULTS="kill:1:30,stop:0:12,term:2:40"``: kind, worker index or ``rN`` for whichever worker
holds rank N, step), each leaving a marker;
``raise`` is a bug in the user's own code: a ``RuntimeError`` whose message reads like a network
error;
``stop-commit`` freezes the worker right before its commit, so that the others wait for it inside
the commit's membership agreement; ``stop-durable`` freezes it right after an epoch's
``commit(durable=True)`` returned, with the checkpoint's write in flight (``BALLAST_MB`` adds a
tensor of that size to the state, so that the write lasts long enough to be caught); ``slow``
makes one step last ``SLOW_STEP_MS`` (3000) longer; ``children`` starts children that outlive
the worker without Python's fork (``tests.workers.children``; pids in ``children-{index}.pids``);
``python``, ``native``, ``gc`` and ``starve`` keep it busy without freezing it
(``tests.workers.busy``, for ``SLOW_STEP_MS``);
``kill-freezing-loaders`` stops its ``DataLoader`` workers (SIGSTOP: they never exit, and keep
open whatever they inherited) and then kills the worker; their pids are in the marker, for the
test to end.
``FAULTFS_PLAN`` makes ``faultfile://`` checkpoint URLs fail reads or stall writes
(``tests/support/faulty_fs.py``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import multiprocessing
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from elastic import ElasticSampler, ElasticState
from tests.workers.sync_points import hold_until_change, hold_until_world, wait_for_peers
from tests.workers.busy import busy
from tests.workers.children import start_children
from tests.workers.markers import write_marker
from tests.workers.pacing import compute_for


class Regression(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g, dtype=torch.float64)
        w = torch.arange(1, 9, dtype=torch.float64) / 8
        self.y = self.x @ w + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=480)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--commit-every", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--persistent-loader", action="store_true",
                   help="one DataLoader made before run(), persistent_workers=True")
    p.add_argument("--hold-at", type=int, default=-1,
                   help="commit step from which every commit waits for world --hold-world")
    p.add_argument("--hold-world", type=int, default=3)
    p.add_argument("--hold-for-change-at", type=int, default=-1,
                   help="commit step that waits, once, until a membership change is agreed")
    return p.parse_args()


def fire_faults(state: ElasticState, out: Path, index: int, moment: str = "step") -> None:
    """Fires this worker's faults that are due at ``moment``: "step" (after a step), "commit"
    (kinds ending in "-commit": right before the commit() of a step) or "durable" (kinds ending
    in "-durable": right after an epoch's durable commit returned)."""
    for spec in filter(None, os.environ.get("FAULTS", "").split(",")):
        kind, who, step = spec.split(":")
        # who: a worker index, or "r0", "r1", ...: whichever worker holds that rank at the step
        mine = state.rank == int(who[1:]) if who.startswith("r") else int(who) == index
        when = kind.rpartition("-")[2] if kind.endswith(("-commit", "-durable")) else "step"
        if not mine or state.step < int(step) or when != moment:
            continue
        marker = out / f"fired-{kind}-{who}"
        if marker.exists():
            continue
        loaders = [child.pid for child in multiprocessing.active_children()] \
            if kind == "kill-freezing-loaders" else []
        write_marker(marker, {"step": state.step, "rank": state.rank, "index": index,
                              "world": state.world_size, "version": state.version,
                              "t": time.time(), "loaders": loaders})
        if kind == "raise":
            raise RuntimeError("file closed: the user's own error (connection, socket, timeout)")
        if kind == "slow":  # one long step (no collective in it): a live member, only slow
            compute_for(float(os.environ.get("SLOW_STEP_MS", "3000")))
            continue
        if kind in ("python", "native", "gc", "starve"):  # busy, never frozen
            busy(kind, out, index, float(os.environ.get("SLOW_STEP_MS", "3000")) / 1000)
            continue
        if kind == "children":
            start_children(out / f"children-{index}.pids")
            continue
        if kind == "stuck":  # blocked like a collective that its release did not wake
            wake, keep_open = os.pipe()
            os.read(wake, 1)  # nothing ever writes: only a restart in place ends this
            os.close(keep_open)
            continue
        for pid in loaders:
            os.kill(pid, signal.SIGSTOP)
        sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP,
               "stop-commit": signal.SIGSTOP, "stop-durable": signal.SIGSTOP,
               "kill-freezing-loaders": signal.SIGKILL}[kind]
        os.kill(os.getpid(), sig)


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # the harness dumps every thread's stack on a hang
    logging.basicConfig(level=os.environ.get("ELASTIC_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(threadName)s %(name)s %(message)s")
    args = parse()
    if os.environ.get("FAULTFS_PLAN"):  # registers faultfile:// with the plan it names
        import tests.support.faulty_fs  # noqa: F401, PLC0415
    out = Path(args.out)
    index = int(os.environ["TEST_WORKER_INDEX"])
    torch.manual_seed(index)  # different initial weights: the sync must make them equal
    dataset = Regression(args.samples)
    model = torch.nn.Linear(8, 1, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ElasticSampler(dataset, seed=7, batch_size=args.batch)
    state = ElasticState(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0,
                         ledger=[[] for _ in range(args.epochs)],
                         skipped=[[] for _ in range(args.epochs)],
                         ballast=torch.zeros(int(os.environ.get("BALLAST_MB", "0")) << 18))
    progress = open(out / f"progress-{index}.jsonl", "a", buffering=1)

    def after_reset(s: ElasticState) -> None:
        flat = torch.cat([p.detach().flatten() for p in s.model.parameters()])
        progress.write(json.dumps({"event": "reset", "gen": s.generation, "rank": s.rank,
                                   "world": s.world_size, "step": s.step,
                                   "params": flat.tolist()}) + "\n")

    state.on_reset(after_reset)

    def make_loader() -> DataLoader:
        return DataLoader(dataset, batch_size=args.batch, sampler=state.sampler,
                          num_workers=args.loader_workers,
                          persistent_workers=args.persistent_loader and args.loader_workers > 0)

    kept = make_loader() if args.persistent_loader else None

    def train(s: ElasticState) -> dict:
        ddp = DDP(s.model)
        loader = kept or make_loader()
        pending: list[int] = []
        while s.epoch < args.epochs:
            s.sampler.set_epoch(s.epoch)
            for x, y, idx in loader:
                loss = torch.nn.functional.mse_loss(ddp(x).squeeze(1), y)
                s.optimizer.zero_grad()
                loss.backward()
                s.optimizer.step()
                s.sampler.record_batch(len(idx))
                pending.extend(idx.tolist())
                s.step += 1
                progress.write(json.dumps({"step": s.step, "epoch": s.epoch, "rank": s.rank,
                                           "world": s.world_size, "gen": s.generation,
                                           "loss": loss.item(), "t": time.time()}) + "\n")
                fire_faults(s, out, index)
                compute_for(args.step_ms)
                if s.sampler.batches_done % args.commit_every == 0:
                    record(s, pending)
                    fire_faults(s, out, index, "commit")
                    s.commit()
                    if args.hold_at >= 0 and s.step >= args.hold_at:
                        hold_until_world(s, args.hold_world)
                    if 0 <= args.hold_for_change_at <= s.step:
                        hold_until_change(s, out, index)
            record(s, pending)
            s.skipped[s.epoch] = s.sampler.skipped_indices()
            s.epoch += 1
            s.commit(durable=True)
            fire_faults(s, out, index, "durable")
        return {"loss": full_loss(s.model, dataset)}

    def record(s: ElasticState, pending: list[int]) -> None:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, pending)
        s.ledger[s.epoch].extend(i for part in everyone for i in part)
        pending.clear()

    wait_for_peers(out, index)
    result = state.run(train)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    (out / f"result-{index}.json").write_text(json.dumps({
        "result": result, "params": flat.tolist(), "ledger": state.ledger,
        "skipped": state.skipped,
        "member": state.member_id, "generation": state.generation, "step": state.step}))


def full_loss(model: torch.nn.Module, dataset: Regression) -> float:
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(dataset.x).squeeze(1), dataset.y).item()


if __name__ == "__main__":
    main()
