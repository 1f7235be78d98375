"""A worker that trains two short epochs with a durable commit at each epoch's end.

``--checkpoint URL`` is given to ElasticState in code (as the README's example does).
"""

import argparse

import torch

from elastic import ElasticState

p = argparse.ArgumentParser()
p.add_argument("--checkpoint", required=True)
p.add_argument("--epochs", type=int, default=2)
args = p.parse_args()

state = ElasticState(model=torch.nn.Linear(4, 1), epoch=0, step=0, checkpoint=args.checkpoint)


def train(s: ElasticState) -> None:
    while s.epoch < args.epochs:
        for _ in range(5):
            s.step += 1
            s.commit()
        s.epoch += 1
        s.commit(durable=True)


state.run(train)
print(f"worker done at epoch {state.epoch}", flush=True)
