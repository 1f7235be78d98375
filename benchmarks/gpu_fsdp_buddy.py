"""The ``buddy`` part of ``gpu_fsdp.py``: the buddy send of a commit taken from device memory,
between two processes on the one GPU (why two processes and how: ``gpu_fsdp.py``'s docstring).

Owns the two ranks: each trains its own FSDP2 model over a world of one of its own (an NCCL
subgroup of one on the GPU; gloo in the CPU dry run), and at every commit sends the rows a rank
of a 2-way shard owns to the other over a gloo group of two with ``BuddyExchange``, on its
thread, while it trains on. Imported as ``gpu_fsdp_buddy``.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

from elastic.cluster.links.ports import free_port
from elastic.state.sharded.commits import ShardCommit, ShardCommits
from elastic.state.sharded.copies import BuddyExchange
from elastic.state.sharded.layout import shard_range
from elastic.state.sharded.shards import flat_tensors, host_copy, sharded_state_dict, spec_of

WORLD = 2
WAIT = timedelta(seconds=120)


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Buddies:
    """One rank's commits: the host copy of its state, the rows of its 2-way shard kept as its
    own, sent to its buddy on a thread."""

    def __init__(self, trainer, rank: int, group) -> None:
        self.trainer, self.rank = trainer, rank
        self.exchange = BuddyExchange(group, rank, WORLD, 1, [0] * WORLD)
        self.commits = ShardCommits(max_held=2)
        self.version = 0
        self.last: ShardCommit | None = None

    def take(self) -> ShardCommit:
        """Waits for the last commit's copies (``before_commit``), then takes this one."""
        self.exchange.wait(WAIT)
        flat = flat_tensors(*sharded_state_dict(self.trainer.model, self.trainer.optimizer))
        specs = {name: spec_of(value) for name, value in flat.items()}
        full = host_copy(flat, self.trainer.buffers)  # a dropped commit's slab, as the refresh
        self.trainer.keep(full)  # part takes it: the one two commits back is reused
        own = {name: full[name][slice(*shard_range(specs[name].rows, WORLD, self.rank))]
               if specs[name].sharded else full[name] for name in full}
        self.version += 1
        self.last = ShardCommit(self.version, WORLD, WORLD, self.rank, specs, {},
                                {self.rank: own})
        self.commits.add(self.last)
        return self.last

    def segment(self, steps: int, commit_every: int) -> float:
        """Seconds for ``steps`` steps, a commit sent at the middle of every ``commit_every``
        (0: none), the last exchange waited for before the clock stops."""
        device = self.trainer.device
        t0 = _synced(device)
        for i in range(1, steps + 1):
            self.trainer.step()
            if commit_every and i % commit_every == commit_every // 2:
                self.exchange.start(self.take(), self.commits)
        self.exchange.wait(WAIT)
        return _synced(device) - t0


def _synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _rank(rank: int, port: int, kind: str, sizes: tuple[int, int, int], turns: tuple[int, int],
          commit_every: int, results: str) -> None:
    from gpu_fsdp import Trainer, fsdp_model  # noqa: PLC0415  (gpu_fsdp imports this module)

    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=WAIT)
    dist.init_process_group("cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo", store=store,
                            rank=rank, world_size=WORLD, timeout=WAIT)
    solo = [dist.new_group([r], backend="nccl" if kind == "cuda" else "gloo")
            for r in range(WORLD)][rank]
    copies = dist.new_group(backend="gloo", timeout=WAIT)  # ShardedRuntime's group of a round
    dist.barrier(group=copies)
    width, layers, batch = sizes
    mesh = DeviceMesh.from_group(solo, device.type, mesh_dim_names=("shard",))
    model, optimizer = fsdp_model(width, layers, mesh, device)
    buddies = Buddies(Trainer(model, optimizer, batch, width, device), rank, copies)
    rounds, steps = turns
    buddies.segment(commit_every, commit_every)  # warm: Adam's state, pinned buffers
    pairs = []
    for r in range(rounds):
        order = ("plain", "ours") if r % 2 == 0 else ("ours", "plain")
        seconds = {k: buddies.segment(steps, commit_every if k == "ours" else 0) for k in order}
        pairs.append(seconds["plain"] / seconds["ours"])
    alone, sent = [], 0
    for _ in range(3):
        commit = buddies.take()
        dist.barrier(group=copies)
        t0 = time.perf_counter()
        sent = buddies.exchange.exchange(commit, buddies.commits)
        alone.append(time.perf_counter() - t0)
    mine = _digest(buddies.last.held[rank])
    theirs = _digest(buddies.last.held[1 - rank]) if 1 - rank in buddies.last.held else None
    digests: list = [None] * WORLD
    dist.all_gather_object(digests, (mine, theirs), group=copies)
    dist.barrier(group=copies)
    dist.destroy_process_group()
    Path(results, f"rank{rank}.json").write_text(json.dumps({
        "parameters": sum(p.numel() for p in model.parameters()),
        "ratios": pairs, "ratio_median": statistics.median(pairs),
        "exchange_s_median": statistics.median(alone), "bytes_sent": sent,
        "exchange_gb_per_s": sent / statistics.median(alone) / 1e9,
        "holds_buddys_shard_bit_for_bit": digests[1 - rank][0] == theirs}))


def buddy_checks(kind: str, width: int, layers: int, batch: int, rounds: int, steps: int,
                 commit_every: int, timeout_s: float) -> dict:
    """Runs the two ranks; their figures and checks, and whether both exited 0."""
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gpu-fsdp-buddy-") as results:
        procs = [ctx.Process(target=_rank, args=(r, port, kind, (width, layers, batch),
                                                 (rounds, steps), commit_every, results))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        codes = [p.exitcode for p in procs]
        found = {p.stem: json.loads(p.read_text()) for p in sorted(Path(results).glob("*.json"))}
    summary: dict = {"exit_codes": codes, "both_exited_0": codes == [0] * WORLD, **found}
    if len(found) == WORLD:
        summary["ratio_median"] = statistics.median(
            x for v in found.values() for x in v["ratios"])
        summary["exchange_gb_per_s_median"] = statistics.median(
            v["exchange_gb_per_s"] for v in found.values())
    return summary
