"""Commit copies from GPU memory to host memory: pinned buffers, non-blocking copies on a side
stream, and one wait before the commit counts.

A blocking copy from a GPU into pageable memory is staged by the driver and stalls the host once
per tensor. Into pinned (page-locked) buffers, copies run as DMA; issued with
``non_blocking=True`` on a stream of their own, they queue behind the step's work (the side
stream first waits for the current one) and the host waits once, for all of them, before the
snapshot is used. Owns only that; which tensors to copy is ``stateful``'s business. Torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["copy_to_host", "host_buffer"]


def host_buffer(src: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped like ``src``: pinned when ``src`` lives on a CUDA device (so
    that copies into it can be asynchronous), ordinary otherwise."""
    return torch.empty_like(src, device="cpu", pin_memory=src.device.type == "cuda")


def _accelerator(device: torch.device) -> Any | None:
    """The torch module that owns ``device``'s streams (``torch.cuda``), or None."""
    return torch.cuda if device.type == "cuda" else None


def copy_to_host(pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 accelerator_of: Callable[[torch.device], Any | None] = _accelerator) -> None:
    """Copies every ``(host buffer, device source)`` pair; returns once all of them landed.

    Per source device: a side stream waits for the device's current stream (the step that wrote
    the sources), takes every copy with ``non_blocking=True``, and is synchronised before this
    returns, so a commit never counts a half-copied snapshot. Devices without streams copy
    one tensor at a time, blocking.

    Args:
        pairs: host buffers and the device tensors to copy into them.
        accelerator_of: the stream module of a device (a test passes its own).
    """
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for buffer, src in pairs:
        by_device.setdefault(src.device, []).append((buffer, src))
    for device, group in by_device.items():
        accelerator = accelerator_of(device)
        if accelerator is None:
            for buffer, src in group:
                buffer.copy_(src)
            continue
        stream = accelerator.Stream(device=device)
        stream.wait_stream(accelerator.current_stream(device))
        with accelerator.stream(stream):
            for buffer, src in group:
                buffer.copy_(src, non_blocking=True)
        stream.synchronize()
