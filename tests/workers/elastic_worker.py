"""A small ElasticState worker for the CLI tests: a linear model, a commit every 5 steps."""

import argparse
import faulthandler
import logging
import os
import signal

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic import ElasticState
from tests.workers.pacing import compute_for

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=100)
p.add_argument("--step-ms", type=float, default=20.0)
args = p.parse_args()
logging.basicConfig(level=os.environ.get("ELASTIC_LOG_LEVEL", "WARNING").upper(),
                    format="%(asctime)s %(name)s %(message)s")
faulthandler.register(signal.SIGUSR1)  # a test dumps every thread's stack on a hang

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
state = ElasticState(model=model, optimizer=opt, step=0)


def train(s: ElasticState) -> None:
    ddp = DDP(s.model)
    while s.step < args.steps:
        loss = ddp(torch.ones(8, 4)).pow(2).mean()
        s.optimizer.zero_grad()
        loss.backward()
        s.optimizer.step()
        s.step += 1
        compute_for(args.step_ms)
        if s.step % 5 == 0:
            s.commit()


state.run(train)
print(f"worker done at step {state.step}", flush=True)
