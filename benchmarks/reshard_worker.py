"""The worker of ``bench_reshard.py``: an FSDP2 model of stacked square layers with AdamW under
``ElasticState(parallelize=...)``, constant global batch, ``commit()`` every ``--commit-every``
steps, one progress line per step (pid, rank, world, step, time, resident memory).

``--width 2900 --layers 12`` is ~101M parameters (~1.2 GB with AdamW's two moments); ``--small``
in the benchmark uses a few MB. ``--buddies 0`` keeps no buddy copies (memory comparison). The
model is built on the meta device and each rank initialises its own shards (``--full-init``:
every rank builds the whole model first, as the benchmark did until 2026-11-29).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from elastic import ElasticSampler, ElasticState


def rss_mb() -> float:
    """This process's resident memory, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def build(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def parallelize(width: int, layers: int, mesh: DeviceMesh | None = None, meta: bool = True,
                init: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model sharded with FSDP2 on ``mesh`` (all ranks when None) and its AdamW: what the
    elastic worker's ``parallelize``, the DCP anchor and the plain loop all build.

    ``meta``: the FSDP2 idiom for a model that does not fit one device (docs/sharded.md):
    built on the meta device, sharded, then each rank allocates and initialises only its own
    shards (``init``: False when the formation fills them, ``ElasticState.restoring``).
    Otherwise every rank builds and initialises the whole model on the CPU first.
    """
    if mesh is None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if meta:
        with torch.device("meta"):
            model = build(width, layers)
    else:
        model = build(width, layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if meta:
        model.to_empty(device="cpu")
    if meta and init:
        bound = width ** -0.5  # nn.Linear's default range, drawn on this rank's shard only
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().uniform_(-bound, bound)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def dataset(width: int) -> TensorDataset:
    return TensorDataset(torch.randn(4096, width, generator=torch.Generator().manual_seed(1)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--width", type=int, default=2900)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--commit-every", type=int, default=10, help="0: no commit in the loop")
    p.add_argument("--buddies", type=int, default=1)
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--full-init", action="store_true",
                   help="build and initialise the whole model on every rank (not on meta)")
    args = p.parse_args()
    torch.set_num_threads(1)

    def objects(mesh):
        model, optimizer = parallelize(args.width, args.layers, mesh, meta=not args.full_init,
                                       init=not state.restoring)
        return {"model": model, "optimizer": optimizer}

    data = dataset(args.width)
    sampler = ElasticSampler(data, seed=0, global_batch_size=args.global_batch)
    state = ElasticState(parallelize=objects, buddies=args.buddies, sampler=sampler,
                         epoch=0, step=0)
    progress = open(Path(args.out) / f"progress-{os.getpid()}.jsonl", "a", buffering=1)

    commit_s = None  # how long the last commit() in the loop took (its own thread's part)

    def train(s: ElasticState) -> None:
        nonlocal commit_s
        loader = DataLoader(data, batch_sampler=s.sampler)
        while s.step < args.steps:
            s.sampler.set_epoch(s.epoch)
            for (x,) in loader:
                share = s.sampler.share()
                (s.model(x).pow(2).mean() * share.loss_scale).backward()
                s.optimizer.step()
                s.optimizer.zero_grad()
                s.sampler.record_batch(len(x))
                s.step += 1
                progress.write(json.dumps({"pid": os.getpid(), "rank": s.rank,
                                           "world": s.world_size, "step": s.step,
                                           "t": time.time(), "rss_mb": rss_mb(),
                                           "commit_s": commit_s}) + "\n")
                if args.commit_every and s.step % args.commit_every == 0:
                    started = time.perf_counter()
                    s.commit()
                    commit_s = time.perf_counter() - started
                if s.step >= args.steps:
                    return
            s.epoch += 1

    state.run(train)


if __name__ == "__main__":
    main()
