"""A small decoder-only transformer language model, sharded with FSDP2, elastic.

Byte-level, trained on the English help text Python ships with (``pydoc_data.topics``: no
download). The library calls ``parallelize(mesh)`` at every formation: it builds the model,
applies ``fully_shard`` to each block and to the root on the mesh of the round (with bf16
compute where the device supports it, i.e. CUDA), and builds AdamW over the sharded parameters.
When a worker dies the survivors reshard the last commit in memory and carry on; when one joins
they reshard again. ``commit(durable=True)`` at each epoch's end writes every rank's shards to
the checkpoint URL (``torch.distributed.checkpoint`` format). Loss goes down; rank 0 prints it.

Run: ``elastic run -n 3 --checkpoint DIR examples/fsdp_lm.py`` (``--size tiny`` for a demo
that takes seconds per epoch on a CPU; the default is ~11M parameters).
"""

import argparse
import math
import time

import torch
from pydoc_data.topics import topics
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset

from elastic import ElasticSampler, ElasticState

SIZES = {  # layers, width, heads, context
    "tiny": (2, 64, 4, 32),
    "small": (6, 384, 6, 128),  # ~10.9M parameters
}


class Bytes(Dataset):
    """Windows of ``context + 1`` bytes of the text, every ``context // 2`` bytes."""

    def __init__(self, context: int, limit: int | None = None) -> None:
        text = "\n\n".join(topics[k] for k in sorted(topics)).encode()[:limit]
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.context, self.stride = context, context // 2

    def __len__(self) -> int:
        return (len(self.data) - self.context - 1) // self.stride

    def __getitem__(self, i: int):
        chunk = self.data[i * self.stride:i * self.stride + self.context + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no)")
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--text-bytes", type=int, default=None, help="use only this much text")
    p.add_argument("--step-ms", type=float, default=0.0, help="extra time per step (demo pacing)")
    args = p.parse_args()
    layers, width, heads, context = SIZES[args.size]
    dataset = Bytes(context, args.text_bytes)
    compute = {}  # the dtype parallelize chose, printed once

    def parallelize(mesh):  # called by the library at every formation
        torch.manual_seed(0)  # the same initial weights whatever the world
        device = mesh.device_type
        bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
        compute["dtype"] = "bfloat16" if bf16 else "float32"
        model = LM(layers, width, heads, context).to(device)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}

    sampler = ElasticSampler(dataset, seed=0, global_batch_size=args.global_batch)
    state = ElasticState(parallelize=parallelize, sampler=sampler, epoch=0, step=0)

    def train(state):
        loader = DataLoader(dataset, batch_sampler=state.sampler)
        parameters = sum(p.numel() for p in state.model.parameters())
        state.print(f"{parameters / 1e6:.1f}M parameters, compute in {compute['dtype']}",
                    flush=True)
        while state.epoch < args.epochs:
            state.sampler.set_epoch(state.epoch)
            for x, y in loader:
                model, device = state.model, next(state.model.parameters()).device
                share = state.sampler.share()  # this rank's part of the constant global batch
                logits = model(x.to(device)).float()
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(),
                                                   reduction="sum") / x.shape[1]
                (loss * share.loss_scale).backward()
                state.optimizer.step()
                state.optimizer.zero_grad()
                state.sampler.record_batch(len(x))
                state.step += 1
                time.sleep(args.step_ms / 1000)
                if state.step % 5 == 0:
                    mean = loss.item() / max(len(x), 1)
                    state.print(f"epoch {state.epoch} step {state.step} world "
                                f"{state.world_size} loss {mean:.3f}", flush=True)
                if args.max_steps and state.step >= args.max_steps:
                    state.print(f"final loss {loss.item() / max(len(x), 1):.3f}", flush=True)
                    return
                if state.sampler.batches_done % 10 == 0:
                    state.commit()  # a host copy of every shard, and one on a buddy
            state.epoch += 1
            state.commit(durable=True)  # every rank's shards to the checkpoint URL

    state.run(train)


if __name__ == "__main__":
    main()
