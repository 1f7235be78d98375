"""How the test workers make a step last longer without sleeping."""

from __future__ import annotations

import time

import torch


def compute_for(ms: float) -> None:
    """Stands in for a bigger model's forward and backward: real matmuls for about ``ms``.

    Keeps a job running long enough for a test's faults and joiners to land mid-epoch; the
    result is dropped, so the model, its parameters and the random streams are untouched.
    """
    deadline = time.monotonic() + ms / 1000
    x = torch.full((64, 64), 0.01, dtype=torch.float32)
    while time.monotonic() < deadline:
        x = torch.tanh(x @ x)
