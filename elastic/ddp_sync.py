"""Whether every rank already holds rank 0's parameters and buffers of a module, so that
``state.ddp`` can skip DistributedDataParallel's own broadcast of them.

DDP's constructor (``init_sync=True``) checks the parameters' shapes across ranks and sends rank
0's parameters and buffers to every other rank: a whole model's worth of traffic at every
formation, for state the formation has just made the same everywhere. This module owns the check
that makes skipping it safe: a digest of the module's tensors (their count, sizes, which ones
train, and the sum of each one's bytes read as 64-bit words, exact and in any order, each
weighted by its position) compared across the ranks with one small all-gather. Any difference
(a parameter no commit holds, a write on one rank only, through ``.data`` or not, drift
between ranks, another shape) keeps torch's default, which then syncs or reports it as it
always did.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic.state.sync import transport_device

_FIELDS = 6  # not digestible, tensors, elements, trainable, sum of sums, weighted sum


def digest(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``tensors`` summed up in ``_FIELDS`` int64 numbers on ``device`` (sums wrap around); the
    first is 1 when some tensor has no plain memory to read (sparse, quantized, meta), and the
    others are then 0."""
    sums = []
    for tensor in tensors:
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
            flag = torch.zeros(_FIELDS, dtype=torch.int64, device=device)
            flag[0] = 1
            return flag
        sums.append(_word_sum(tensor).to(device))
    total = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=device)
    weights = torch.arange(1, len(sums) + 1, dtype=torch.int64, device=device)
    counts = torch.tensor([0, len(tensors), sum(t.numel() for t in tensors),
                           sum(t.requires_grad for t in tensors)], dtype=torch.int64,
                          device=device)
    return torch.cat([counts, torch.stack([total.sum(), (total * weights).sum()])])


def _word_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s bytes read as int64 words (the last few bytes on their own):
    one pass at memory speed, where a float64 sum of float32 values converts every element."""
    raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:  # not 8-byte aligned in its storage
        words = raw[:whole].clone().view(torch.int64)
    return words.sum() + raw[whole:].to(torch.int64).sum()


def same_on_every_rank(module: torch.nn.Module, group: dist.ProcessGroup | None = None) -> bool:
    """Whether every rank of ``group`` (None: the default group) holds the same parameters and
    buffers of ``module`` (by ``digest``); collective."""
    mine = digest(list(module.parameters()) + list(module.buffers()), transport_device(group))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return int(mine[0]) == 0 and all(torch.equal(row, mine) for row in everyone)
