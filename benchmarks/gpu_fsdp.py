"""Sharded state (FSDP2) on a real GPU, in one run: issue 43 item 8.

Usage: ``python benchmarks/gpu_fsdp.py [--parts versions,example,refresh,buddy] [--out DIR]``.
Prints one line per part and writes ``gpu-fsdp-{part}.json`` under ``--out`` (and the example's
log as ``example-log.txt``). Exits 1 when a check fails. ``--device cpu`` runs the same code on
the CPU with gloo (a dry run of the script; the suite runs it with small sizes).

- ``versions``: torch, CUDA, NCCL, the GPU and its driver.
- ``example``: ``examples/fsdp_lm.py`` under ``elastic run -n 1`` (embedded etcd, ``--backend
  nccl``: an NCCL world of one), bf16 compute through its ``MixedPrecisionPolicy``, a file://
  checkpoint URL, ``--example-epochs`` whole epochs (a durable sharded commit at each epoch's
  end). Checks: it exited 0, the loss went down, the compute dtype was bf16 (float32 on the CPU),
  a durable sharded checkpoint (manifest, DCP ``.metadata`` and shards) was written. Figures:
  loss first -> last, steps/s after the first quarter of the loss lines.
- ``refresh``: what a sharded commit costs from device memory. One process, an NCCL world of one
  formed through ``ProcessGroup`` (as ``gpu_check.py`` does), ~104M parameters (the MLP of
  ``reshard_worker.py`` at ``--width 2944 --layers 12``: 2900 there, here a multiple of 128 for
  the tensor cores) built on the meta device, ``fully_shard``
  on each layer and the root (bf16 ``MixedPrecisionPolicy`` on CUDA), AdamW on the GPU. The
  commit is the project's own path: ``host_copy(flat_tensors(sharded_state_dict(...)))``
  (``state/sharded/shards.py``: one pinned slab per shard, non-blocking copies on a side
  stream, ``state/device_copy.py``), the last two kept alive and the slab of the one dropped
  reused as ``ShardCommits`` does (``state/sharded/buffers.py``). Timed
  with ``synchronize``, taking turns: ``--rounds`` pairs of ``--steps`` plain FSDP2 steps and
  ``--steps`` steps with that commit every ``--commit-every``; the steady ratio is ours over
  plain in steps/s, per pair (item 7's target on the CPU: >= 0.97). Then the commit alone
  (``--copies`` times): the state dict's seconds, the host copy's seconds, bytes and GB/s
  (into the recycled slab), the same copies into the oldest held commit's buffers (the copies
  alone), and the anchor: the same
  local tensors copied blocking into fresh pageable memory (``.to("cpu")``).
  Checks: the host copy equals the device tensors bit for bit and is pinned (on CUDA).
- ``buddy``: the buddy SEND (``BuddyExchange``, ``state/sharded/copies.py``) of a commit taken
  from device memory. Not in a world of one: ``buddy_ranks`` of a world of one is empty (there
  is nobody to hold a copy), so nothing is sent. Not as one FSDP2 world of two on the one GPU
  either: NCCL refuses two ranks on one device, and FSDP2's all-gather and reduce-scatter of
  CUDA tensors are not gloo's. So two processes on the one GPU, each training its own model
  (the ``refresh`` model, ``--buddy-width``) with FSDP2 over an NCCL world of one (its own
  subgroup), joined by a gloo group of two for the copies, as ``ShardedRuntime`` opens one
  per round. At each commit a rank takes the host copy of its state as above and keeps the
  rows that rank ``r`` of a 2-way shard would own (``shard_range``): the bytes a rank of an
  FSDP world of two sends. The exchange runs on its thread while training goes on, and the
  next commit first waits for it (``ShardedRuntime.before_commit``). The exchange's tensors
  are pinned host memory, never CUDA tensors (the host copy is what is sent). Figures: the
  exchange alone (seconds, GB/s a rank sends), and steps/s with commit + exchange every
  ``--commit-every`` steps over plain steps, both processes taking the same turns (they share
  the GPU, so one's commit lends the GPU to the other: that ratio understates the cost; the
  exchange's own seconds are the figure). Checks: each rank holds its buddy's shard bit for
  bit (SHA-256 against the sender's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from gpu_check import versions as gpu_versions  # noqa: E402
from gpu_fsdp_example import example  # noqa: E402
from elastic.cluster.links.process_group import ProcessGroup  # noqa: E402
from elastic.state.device_copy import copy_to_host  # noqa: E402
from elastic.state.sharded.buffers import ShardBuffers  # noqa: E402
from elastic.state.sharded.shards import (flat_tensors, host_copy, local_part,  # noqa: E402
                                          sharded_state_dict)

PARTS = ("versions", "example", "refresh", "buddy")
KEEP = 2  # commits held alive at once (ShardCommits keeps the newest two)


def versions() -> dict:
    """``gpu_check.py``'s versions, and where the ``elastic`` package was imported from."""
    import elastic  # noqa: PLC0415

    return {**gpu_versions(), "elastic_from": str(Path(elastic.__file__).parent)}


# -- refresh ---------------------------------------------------------------------------------
def world_of_one(device: torch.device) -> ProcessGroup:
    """An NCCL world of one on GPU 0 (gloo on the CPU), formed the way a worker forms it."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = ProcessGroup(backend, timeout=timedelta(seconds=120), skip_ports=frozenset(),
                         form_timeout=timedelta(seconds=60),
                         device_index=0 if device.type == "cuda" else None)
    group.form(dist.HashStore(), rank=0, world_size=1)
    return group


def build(width: int, layers: int) -> torch.nn.Module:
    """``reshard_worker.build``'s model (not imported: that module loads the whole library)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def fsdp_model(width: int, layers: int, mesh, device: torch.device
               ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``reshard_worker``'s MLP, built on meta, sharded on ``mesh``, initialised on ``device``
    (bf16 compute on CUDA), with AdamW."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else None)
    with torch.device("meta"):
        model = build(width, layers)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().uniform_(-width ** -0.5, width ** -0.5)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Trainer:
    """Plain FSDP2 steps on one fixed batch, and the commit of their state to host memory."""

    def __init__(self, model, optimizer, batch: int, width: int, device: torch.device) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.x = torch.randn(batch, width, device=device,
                             generator=torch.Generator(device=device).manual_seed(0))
        self.held: deque = deque(maxlen=KEEP)
        self.buffers = ShardBuffers(limit=1)  # what ShardCommits recycles of dropped commits

    def keep(self, copy: dict[str, torch.Tensor]) -> None:
        """Keeps ``copy`` as the newest commit; the one that goes is reused."""
        if len(self.held) == KEEP:
            self.buffers.give(self.held[0])
        self.held.append(copy)

    def step(self) -> None:
        self.model(self.x).float().pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def commit(self) -> dict[str, torch.Tensor]:
        """The project's sharded commit of this rank's shards: returns the host copy."""
        copy = host_copy(flat_tensors(*sharded_state_dict(self.model, self.optimizer)),
                         self.buffers)
        self.keep(copy)
        return copy

    def segment(self, steps: int, commit_every: int) -> float:
        """Seconds for ``steps`` steps (a commit after every ``commit_every``-th; 0: none)."""
        t0 = synced(self.device)
        for i in range(1, steps + 1):
            self.step()
            if commit_every and i % commit_every == 0:
                self.commit()
        return synced(self.device) - t0


def refresh(device: torch.device, width: int, layers: int, batch: int, rounds: int, steps: int,
            commit_every: int, copies: int) -> dict:
    group = world_of_one(device)
    try:
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("shard",))
        model, optimizer = fsdp_model(width, layers, mesh, device)
        trainer = Trainer(model, optimizer, batch, width, device)
        result = {"device": str(device), "backend": dist.get_backend(),
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "width": width, "layers": layers, "batch": batch,
                  "compute_dtype": "bfloat16" if device.type == "cuda" else "float32"}
        trainer.segment(commit_every, 0)  # warm: Adam's state exists, kernels are chosen
        t0 = synced(device)
        trainer.commit()  # the first commit allocates its pinned buffers
        result["first_commit_s"] = synced(device) - t0
        result.update(_turns(trainer, rounds, steps, commit_every))
        result.update(_commit_alone(trainer, copies))
        return result
    finally:
        group.release("gpu_fsdp refresh done")
        group.destroy()


def _turns(trainer: Trainer, rounds: int, steps: int, commit_every: int) -> dict:
    """Plain steps and steps with commits, taking turns (the order alternating), one warm pair
    first."""
    pairs = []
    for r in range(rounds + 1):
        order = ("plain", "ours") if r % 2 == 0 else ("ours", "plain")
        seconds = {kind: trainer.segment(steps, commit_every if kind == "ours" else 0)
                   for kind in order}
        if r:
            pairs.append({"plain_steps_per_s": steps / seconds["plain"],
                          "ours_steps_per_s": steps / seconds["ours"],
                          "ratio": seconds["plain"] / seconds["ours"]})
    return {"rounds": rounds, "steps_per_turn": steps, "commit_every": commit_every,
            "pairs": pairs,
            "plain_steps_per_s_median": statistics.median(p["plain_steps_per_s"] for p in pairs),
            "ours_steps_per_s_median": statistics.median(p["ours_steps_per_s"] for p in pairs),
            "ratio_median": statistics.median(p["ratio"] for p in pairs),
            "ratio_min": min(p["ratio"] for p in pairs), "ratio_target_on_cpu": 0.97}


def _commit_alone(trainer: Trainer, copies: int) -> dict:
    """The commit's parts timed alone; beside them, the same copies into the oldest held
    commit's pinned buffers again (what the host copy costs without allocating them), and
    blocking into fresh pageable memory."""
    device = trainer.device
    state_dict_s, copy_s, reused_s, pageable_s = [], [], [], []
    held: deque = deque(maxlen=KEEP)
    for _ in range(copies):
        trainer.step()
        t0 = synced(device)
        flat = flat_tensors(*sharded_state_dict(trainer.model, trainer.optimizer))
        t1 = synced(device)
        copy = host_copy(flat, trainer.buffers)
        t2 = synced(device)
        copy_to_host([(trainer.held[0][n], local_part(v).detach()) for n, v in flat.items()])
        t3 = synced(device)
        trainer.keep(copy)
        held.append({n: local_part(v).detach().to("cpu") for n, v in flat.items()})
        t4 = synced(device)
        state_dict_s.append(t1 - t0)
        copy_s.append(t2 - t1)
        reused_s.append(t3 - t2)
        pageable_s.append(t4 - t3)
    local = {n: local_part(v).detach() for n, v in flat.items()}
    size = sum(c.nbytes for c in copy.values())
    return {"copies": copies, "commit_mib": size / 2**20, "tensors": len(copy),
            "state_dict_s_median": statistics.median(state_dict_s),
            "host_copy_s_median": statistics.median(copy_s),
            "host_copy_gb_per_s": size / statistics.median(copy_s) / 1e9,
            "into_reused_pinned_s_median": statistics.median(reused_s),
            "into_reused_pinned_gb_per_s": size / statistics.median(reused_s) / 1e9,
            "pageable_s_median": statistics.median(pageable_s),
            "pageable_gb_per_s": size / statistics.median(pageable_s) / 1e9,
            "host_copy_equals_device": all(torch.equal(copy[n], local[n].cpu()) for n in local),
            # one slab for the shard, pinned when a source is on the GPU (Adam's step counts,
            # on the CPU, share it)
            "host_copy_pinned_as_expected": all(
                copy[n].is_pinned() == any(t.device.type == "cuda" for t in local.values())
                for n in local)}


def _buddy():
    from gpu_fsdp_buddy import buddy_checks  # noqa: PLC0415  (it imports this module)

    return buddy_checks


# -- the run ---------------------------------------------------------------------------------
def failures(report: dict) -> list[str]:
    """The names of every boolean check that is False."""
    failed = []

    def visit(obj, path):
        if isinstance(obj, dict):
            for key, value in obj.items():
                if isinstance(value, bool):
                    if not value:
                        failed.append(f"{path}{key}")
                else:
                    visit(value, f"{path}{key}.")
    visit(report, "")
    return failed


def _arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the same checks with gloo on the CPU (a dry run of this script)")
    p.add_argument("--out", default=None)
    p.add_argument("--example-epochs", type=int, default=6,
                   help="whole epochs of the example (303 steps each at --example-size small)")
    p.add_argument("--example-size", choices=("tiny", "small"), default="small")
    p.add_argument("--example-text-bytes", type=int, default=None)
    p.add_argument("--example-timeout", type=float, default=120.0)
    p.add_argument("--width", type=int, default=2944,
                   help="with --layers 12: ~104M parameters (a multiple of 128: tensor cores)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=4096, help="rows of the fixed batch per step")
    p.add_argument("--rounds", type=int, default=8, help="pairs of turns, plain and ours")
    p.add_argument("--steps", type=int, default=50, help="steps per turn")
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--copies", type=int, default=8, help="commits timed alone")
    p.add_argument("--buddy-width", type=int, default=2944)
    p.add_argument("--buddy-rounds", type=int, default=4)
    p.add_argument("--buddy-timeout", type=float, default=80.0)
    return p


def main() -> int:
    p = _arguments()
    args = p.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {','.join(PARTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no GPU is visible: run with --device cpu for a dry run on the CPU")
    if args.steps % args.commit_every:
        p.error(f"--steps ({args.steps}) must be a multiple of --commit-every "
                f"({args.commit_every}), so that both turns pay their share of commits")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-fsdp-"))
    out.mkdir(parents=True, exist_ok=True)
    run = {"versions": versions,
           "example": lambda: example(args.device, args.example_epochs, args.example_size,
                                      args.example_text_bytes, args.example_timeout, out),
           "refresh": lambda: refresh(device, args.width, args.layers, args.batch, args.rounds,
                                      args.steps, args.commit_every, args.copies),
           "buddy": lambda: _buddy()(args.device, args.buddy_width, args.layers, args.batch,
                                         args.buddy_rounds, args.steps, args.commit_every,
                                         args.buddy_timeout)}
    failed = []
    for part in parts:
        t0 = time.perf_counter()
        try:
            found = run[part]()
        except Exception as exc:  # noqa: BLE001  (a part's failure is its result; go on)
            found = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
        found["part_s"] = time.perf_counter() - t0
        (out / f"gpu-fsdp-{part}.json").write_text(json.dumps(found, indent=1))
        failed += [f"{part}.{name}" for name in failures(found)]
        shown = {k: v for k, v in found.items() if k not in ("pairs", "command", "ranks")}
        print(f"{part} ({found['part_s']:.1f} s): {json.dumps(shown)}", flush=True)
    print(f"wrote {out}; " + (f"FAILED: {', '.join(failed)}" if failed
                              else "every check passed"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
