"""A sharded (FSDP2 / HSDP) test job: constant global batch, float64, AdamW, under
``ElasticState(parallelize=...)``.

Three Linear layers with uneven dim-0 sizes (7, 13 and 1 rows), built whole on CPU from one seed
and sharded by ``fully_shard`` on the mesh of each round. Every step trains the same global batch
of the ``ElasticSampler`` whatever the world; its global loss goes into a committed ``history``
and its sample indices into a committed ``ledger``. ``FAULT="kill:1,3:10:4"`` makes the ranks 1
and 3 of a world of 4 SIGKILL themselves after step 10 (once); ``kill:1:10:4;slow:2:10:4``
also makes rank 2 compute for ``SLOW_STEP_MS`` then (a long step); ``--hold-at 16:4`` keeps agreeing
on membership at step 16 until the world is 4. ``--copy-free`` commits every step with
``commit_step`` instead of ``commit()`` every ``--commit-every`` steps; ``--copy-free
--with-commits`` also takes a ``commit()`` every ``--commit-every`` steps (docs/sharded.md's
advice under FSDP). Writes the whole parameters (gathered inside the last call) and the
committed history and ledger to ``result-{index}.json``.

``TEST_NET_WIDTH`` changes the second layer's width (13): a worker that builds another model;
``TEST_NET_WIDTH_AT=L:W`` only in the worker of ``elastic run``'s local rank L. Without
``TEST_WORKER_INDEX`` (under ``elastic run``) a worker's index is its local rank.

A fifth field names the point of the step the kill hits (``kill:2:10:4:backward``; ``after`` when
absent), the points of issue 39 in order: ``forward`` (before the forward), ``backward``
(inside the backward, before any parameter's gradient: the peers wait in its reduce-scatter),
``agree`` (after the backward, before the step's last collectives and the agreement),
``block`` (right after ``optimizer.step()``: inside the ``commit_step()`` block, or before the
snapshot commit), ``after`` (after the step is recorded), ``commit`` (right after a
``commit()`` returns, its buddy copies perhaps still in flight; on a commit step), and
``parallelize`` (inside ``parallelize`` at the formation of that world, the step being the one
the formation restores: a death in the middle of a re-formation).

``--durable-at-join STEP`` holds after step STEP until a joiner is seen (the test starts it once
every worker holds), then takes ``commit(durable=True)``: a durable commit that agrees on a
join, so its shards get no buddy copies. ``--commit-at-join STEP`` does the same with a plain
``commit()``, which takes no host copy of its shards either (the live shards are the commit).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from tests.workers.markers import write_marker
from tests.workers.pacing import compute_for
from tests.workers.sync_points import hold_until_join_seen, hold_until_world, wait_for_peers
from elastic import ElasticSampler, ElasticState


def _imports_frozen() -> bool:
    """Whether the objects of ``torch._dynamo``, which a sharded ``run()`` imports ahead on a
    thread, are in the collector's permanent generation (``gc.freeze``), never scanned."""
    module = sys.modules.get("torch._dynamo.eval_frame")
    return module is not None and id(vars(module)) not in {id(o) for o in gc.get_objects()}


class Regression(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 5, generator=g, dtype=torch.float64)
        self.y = torch.tanh(self.x.sum(1) / 3) + 0.01 * torch.randn(n, generator=g,
                                                                     dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        width = int(os.environ.get("TEST_NET_WIDTH", "13"))  # another model: another width
        at, _, wider = os.environ.get("TEST_NET_WIDTH_AT", "").partition(":")
        if at and at == os.environ.get("LOCAL_RANK"):
            width = int(wider)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(5, 7, dtype=torch.float64),
                                           torch.nn.Linear(7, width, dtype=torch.float64)])
        self.head = torch.nn.Linear(width, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).squeeze(1)


def parallelize(mesh, fire=None, restoring=None) -> dict[str, object]:
    """``restoring()``: whether the formation fills the model (``ElasticState.restoring``);
    then its parameters are NaN instead of initialised, so any it left unfilled shows."""
    if fire is not None:
        fire(dist.get_rank(), mesh.size())
    torch.manual_seed(0)  # the same initial weights at any world size
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if restoring is not None and restoring():
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan"))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=0.01)}


def fire_fault(state: ElasticState, out: Path, index: int, where: str, step: int,
               rank: int | None = None, world: int | None = None) -> None:
    """SIGKILLs this process when a spec of ``FAULT`` names this rank, ``step`` (the step being
    trained) and ``where`` in a world of its size, once job-wide per rank (marker
    ``fired-kill-INDEX``); a ``slow`` spec computes ``SLOW_STEP_MS`` instead (``fired-slow-``);
    ``rank`` and ``world`` of a round being formed, when ``state``'s are the last round's."""
    rank = state.rank if rank is None else rank
    world = state.world_size if world is None else world
    for spec in filter(None, os.environ.get("FAULT", "").split(";")):
        kind, ranks, at, want_world, *point = spec.split(":")
        marker = out / f"fired-{kind}-{index}"
        if (step != int(at) or world != int(want_world) or marker.exists()
                or where != (point[0] if point else "after")
                or str(rank) not in ranks.split(",")):
            continue
        write_marker(marker, {"step": step, "rank": rank, "world": world,
                              "where": where, "t": time.time()})
        if kind == "slow":  # one long step with no collective in it: a live member, only slow
            compute_for(float(os.environ.get("SLOW_STEP_MS", "3000")))
            continue
        os.kill(os.getpid(), signal.SIGKILL)


def hold(state: ElasticState, hold_at: str) -> None:
    """At ``--hold-at STEP:WORLD``, agrees on membership until the world is WORLD."""
    if hold_at:
        step, world = (int(v) for v in hold_at.split(":"))
        if state.step == step:
            hold_until_world(state, world, timeout_s=150)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--commit-every", type=int, default=4)
    p.add_argument("--shard-degree", type=int, default=None)
    p.add_argument("--hold-at", default="")
    p.add_argument("--durable", action="store_true", help="durable commits at epoch ends")
    p.add_argument("--copy-free", action="store_true", help="commit every step (commit_step)")
    p.add_argument("--with-commits", action="store_true",
                   help="with --copy-free, also commit() every --commit-every steps")
    p.add_argument("--durable-at-join", type=int, default=0,
                   help="after this step, wait for a joiner, then commit(durable=True)")
    p.add_argument("--commit-at-join", type=int, default=0,
                   help="after this step, wait for a joiner, then commit()")
    args = p.parse_args()
    out = Path(args.out)
    index = int(os.environ.get("TEST_WORKER_INDEX", os.environ.get("LOCAL_RANK", "0")))
    data = Regression(args.samples)
    sampler = ElasticSampler(data, seed=7, global_batch_size=args.global_batch)

    restored: list[list] = []  # (world, restoring) at each formation
    imports_frozen: list[bool] = []  # at its first formation (_imports_frozen)

    def fire_in_parallelize(rank: int, world: int) -> None:
        fire_fault(state, out, index, "parallelize", state.step, rank, world)

    def restoring() -> bool:
        restored.append([dist.get_world_size(), state.restoring])
        if not imports_frozen:
            imports_frozen.append(_imports_frozen())
        return state.restoring

    state = ElasticState(parallelize=functools.partial(parallelize, fire=fire_in_parallelize,
                                                       restoring=restoring),
                         shard_degree=args.shard_degree,
                         sampler=sampler, epoch=0, step=0, history=[],
                         ledger=[[] for _ in range(args.epochs)])
    progress = open(out / f"progress-{index}.jsonl", "a", buffering=1)
    final: dict[str, list[float]] = {}

    def train(s: ElasticState) -> None:
        loader = DataLoader(data, batch_sampler=s.sampler, generator=torch.Generator())
        while s.epoch < args.epochs:
            s.sampler.set_epoch(s.epoch)
            for x, y, ids in loader:
                fire = functools.partial(fire_fault, s, out, index)
                fire("forward", s.step + 1)
                share = s.sampler.share()
                predicted = s.model(x)
                if predicted.requires_grad:
                    predicted.register_hook(lambda g: fire("backward", s.step + 1) or g)
                squared = (predicted - y) ** 2
                s.optimizer.zero_grad()
                (squared.sum() * share.loss_scale).backward()
                fire("agree", s.step + 1)
                total = squared.detach().sum() if share.size else torch.zeros((),
                                                                               dtype=torch.float64)
                dist.all_reduce(total)
                everyone: list = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, ids.tolist())
                with s.commit_step() if args.copy_free else contextlib.nullcontext():
                    s.optimizer.step()
                    fire("block", s.step + 1)
                    s.sampler.record_batch(len(x))
                    s.ledger[s.epoch].extend(i for part in everyone for i in part)
                    s.step += 1
                    s.history.append(total.item() / share.total)
                progress.write(json.dumps({"step": s.step, "world": s.world_size,
                                           "loss": s.history[-1]}) + "\n")
                fire("after", s.step)
                if s.step in (args.durable_at_join, args.commit_at_join):
                    hold_until_join_seen(s, out, index)
                    s.commit(durable=s.step == args.durable_at_join)
                if s.step % args.commit_every == 0:
                    if not args.copy_free or args.with_commits:
                        s.commit()
                        fire("commit", s.step)
                    hold(s, args.hold_at)
            s.epoch += 1
            if not args.copy_free:  # the next agreed step records the new epoch
                s.commit(durable=args.durable)
        final["params"] = torch.cat([p.full_tensor().flatten()
                                     for p in s.model.parameters()]).tolist()

    wait_for_peers(out, index)
    state.run(train)
    (out / f"result-{index}.json").write_text(json.dumps({
        "params": final["params"], "history": state.history, "ledger": state.ledger,
        "step": state.step, "restored": restored, "imports_frozen": imports_frozen}))


if __name__ == "__main__":
    main()
