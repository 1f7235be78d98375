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


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def train_step(ddp: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> float:
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


class Progress:
    """Appends one JSON line per step; flushed per line so a killed worker's file is whole."""

    def __init__(self, out: str, tag: str) -> None:
        Path(out).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(out) / f"progress-{tag}.jsonl", "a", buffering=1)

    def step(self, step: int, rank: int, world: int, **extra: object) -> None:
        self._file.write(json.dumps({"t": time.time(), "step": step, "rank": rank,
                                     "world": world, "pid": os.getpid(), **extra}) + "\n")
