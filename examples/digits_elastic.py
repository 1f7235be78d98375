"""Handwritten digits (scikit-learn's bundled 8x8 images, no download) with a small CNN, elastic.

The same script as ``digits_single.py`` but for 8 lines of code (marked ``# elastic``): the state is
an ElasticState with an ElasticSampler; ``state.ddp`` wraps the model for each round (the
function is re-entered after every re-formation); ``state.batches`` sets the sampler's epoch,
records each batch, commits every 10 batches and durably when the epoch's batches are done;
``state.print`` prints on rank 0 (every rank prints the same final accuracy); ``state.run``
runs it all.
Run: ``elastic run -n 3 [--checkpoint DIR] examples/digits_elastic.py``.
"""

import argparse
import time

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic import ElasticSampler, ElasticState  # elastic


def data():
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=g)
    train, test = order[:1500], order[1500:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def make_model():
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3),
                         nn.ReLU(), nn.Flatten(), nn.Linear(32 * 6 * 6, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def accuracy(model, test):
    with torch.no_grad():
        return (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--step-ms", type=float, default=0.0, help="extra time per step (demo pacing)")
    args = p.parse_args()
    torch.manual_seed(0)
    train_set, test_set = data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ElasticSampler(train_set, seed=0)  # elastic
    state = ElasticState(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)  # elastic

    def train(state):
        net = state.ddp(state.model)  # elastic
        loader = DataLoader(train_set, batch_size=32, sampler=state.sampler)
        while state.epoch < args.epochs:
            for x, y in state.batches(loader, commit_every=10, checkpoint_at_end=True):  # elastic
                loss = nn.functional.cross_entropy(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                state.step += 1
                time.sleep(args.step_ms / 1000)
                if state.step % 10 == 0:
                    state.print(f"epoch {state.epoch} step {state.step} "  # elastic: 2 lines
                                f"world {state.world_size} loss {loss.item():.3f}", flush=True)
            state.epoch += 1
        print(f"final accuracy {accuracy(model, test_set):.4f}", flush=True)

    state.run(train)  # elastic


if __name__ == "__main__":
    main()
