"""The model, data and step shared by every benchmark script, so both sides train the same thing.

Progress lines (JSON, one per completed step: wall time, step, rank, world) go to
``{out}/progress-{tag}.jsonl``; the benchmark driver reads them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

FEATURES, HIDDEN, CLASSES = 64, 512, 10


def pin_to_core() -> None:
    """With ``BENCH_PIN=1``, binds this worker to one core: ``BENCH_CORE``, else ``LOCAL_RANK``.

    Pinned, both sides of a comparison get the same placement of workers and gloo threads. On
    the 2-core machine it made no measurable difference (``benchmarks/RESULTS.md``).
    """
    if os.environ.get("BENCH_PIN") != "1":
        return
    cores = sorted(os.sched_getaffinity(0))
    index = int(os.environ.get("BENCH_CORE", os.environ.get("LOCAL_RANK", "0")))
    os.sched_setaffinity(0, {cores[index % len(cores)]})


def dataset(n: int = 16384) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x[:, :CLASSES] * 3).argmax(dim=1)
    return TensorDataset(x, y)


# ``--size`` of the sweep (``bench_commit_sweep.py``): the hidden width of the same 3-layer MLP,
# which has HIDDEN**2 + (FEATURES + CLASSES + 2) * HIDDEN + CLASSES parameters.
SIZES = {"0.3m": HIDDEN, "1m": 960, "10m": 3125, "100m": 9960}


def model(size: str = "0.3m") -> torch.nn.Module:
    hidden = SIZES[size]
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, CLASSES))


def optimizer(params, kind: str = "sgd") -> torch.optim.Optimizer:
    """SGD with momentum (the default benchmark) or Adam (the sweep: two state tensors a
    parameter, so the snapshot commit copies three times the parameters)."""
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def device(kind: str) -> torch.device:
    """``--device``: the CPU, or this worker's GPU (``LOCAL_RANK``, set by both launchers)."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def gradients(ddp: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
              y: torch.Tensor) -> float:
    """A step up to its update: forward, backward (DDP all-reduces the gradients). The batch
    goes to the model's device first (a copy from the CPU loader when that is a GPU)."""
    target = next(ddp.parameters()).device
    x, y = x.to(target, non_blocking=True), y.to(target, non_blocking=True)
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    return loss.item()


def train_step(ddp: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> float:
    loss = gradients(ddp, opt, x, y)
    opt.step()
    return loss


class Progress:
    """Appends one JSON line per step; flushed per line so a killed worker's file is whole."""

    def __init__(self, out: str, tag: str) -> None:
        Path(out).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(out) / f"progress-{tag}.jsonl", "a", buffering=1)

    def step(self, step: int, rank: int, world: int, **extra: object) -> None:
        self._file.write(json.dumps({"t": time.time(), "step": step, "rank": rank,
                                     "world": world, "pid": os.getpid(), **extra}) + "\n")
