"""The soak's training job: a small regression under ElasticState.run, public API only.

Every committed batch's sample indices are counted in a committed tensor (a rolled-back batch
drops out with the rollback); at each epoch's end the counts become one audit row (duplicated
samples, lost samples), so the soak can check that each epoch saw every sample exactly once. Rank 0
appends ``{"t", "samples", "world"}`` to ``progress.jsonl`` at every commit. The job ends at the
first epoch boundary after the file ``stop`` appears in the output folder (all ranks agree on it
with one all-reduce), and rank 0 writes ``result.json``. ``step`` counts the batches trained
and is committed with the state, so a rolled-back batch is not counted: rank 0's ``progress``
events (with ``ELASTIC_PROGRESS`` small, one per commit) are the ledger of useful steps.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from elastic import ElasticSampler, ElasticState


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--commit-every", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=20.0)
    args = p.parse_args()
    out = Path(args.out)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, 16, generator=g)
    y = x @ torch.linspace(-1, 1, 16) + 0.01 * torch.randn(args.samples, generator=g)
    dataset = TensorDataset(x, y, torch.arange(args.samples))
    model = torch.nn.Linear(16, 1)
    state = ElasticState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                         sampler=ElasticSampler(dataset, seed=3, batch_size=args.batch),
                         epoch=0, step=0, counts=torch.zeros(args.samples, dtype=torch.int16), audit=[])

    def train(s: ElasticState) -> bool:
        ddp = DDP(s.model)
        pending: list[int] = []
        while True:
            s.sampler.set_epoch(s.epoch)
            for xb, yb, idx in DataLoader(dataset, batch_size=args.batch, sampler=s.sampler):
                loss = torch.nn.functional.mse_loss(ddp(xb).squeeze(1), yb)
                s.optimizer.zero_grad()
                loss.backward()
                s.optimizer.step()
                s.sampler.record_batch(len(idx))
                s.step += 1
                pending.extend(idx.tolist())
                time.sleep(args.step_ms / 1000)  # stands in for a longer step of real work
                if s.sampler.batches_done % args.commit_every == 0:
                    record(s, pending)
                    s.commit()
            record(s, pending)
            skipped = torch.zeros(args.samples, dtype=torch.bool)
            skipped[list(s.sampler.skipped_indices())] = True
            s.audit.append([s.epoch, int((s.counts > 1).sum()),
                            int(((s.counts == 0) & ~skipped).sum())])
            s.counts = torch.zeros(args.samples, dtype=torch.int16)
            s.epoch += 1
            s.commit()
            stop = torch.tensor([float((out / "stop").exists())])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() > 0:
                return True

    def record(s: ElasticState, pending: list[int]) -> None:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, pending)
        done = [i for part in everyone for i in part]
        s.counts = s.counts.index_add(0, torch.tensor(done, dtype=torch.long),
                                      torch.ones(len(done), dtype=torch.int16))
        pending.clear()
        if s.rank == 0:
            with open(out / "progress.jsonl", "a") as f:
                f.write(json.dumps({"t": time.time(), "samples": len(done),
                                    "world": s.world_size}) + "\n")

    # None on a worker that left, or that came as the job finished (its state never trained).
    trained = state.run(train)
    if trained and state.rank == 0 and (out / "stop").exists():
        (out / "result.json").write_text(json.dumps(
            {"audit": state.audit, "epochs": state.epoch}))


if __name__ == "__main__":
    main()
