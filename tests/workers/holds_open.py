"""Keeps its job running until the test says: commits once, prints ``holding``, then waits
until the test opens the named pipe ``--release`` for writing, and finishes."""

import argparse

import torch

from elastic import ElasticState

p = argparse.ArgumentParser()
p.add_argument("--release")
args = p.parse_args()
state = ElasticState(model=torch.nn.Linear(4, 1), step=0)


def train(s: ElasticState) -> None:
    s.step += 1
    s.commit()
    if args.release:
        print("holding", flush=True)
        with open(args.release, "rb"):  # returns once the test opens it for writing
            pass


state.run(train)
