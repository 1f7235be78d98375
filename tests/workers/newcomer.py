"""Scripts a newcomer gets wrong, for the launcher's and the worker's one-line answers.

``--checkpoint URL``: the script itself passes ``ElasticState(checkpoint=URL)`` and commits
durably; it prints ``training started`` when its training function is first called.
``--skip-run``: builds its ElasticState and exits 0 without calling ``state.run()``.
``--late-s S``: the worker of LOCAL_RANK 1 reaches its ElasticState S seconds after it started
(a slow import, as under load).
"""

import argparse
import os
import threading

import torch

from elastic import ElasticState

p = argparse.ArgumentParser()
p.add_argument("--checkpoint")
p.add_argument("--skip-run", action="store_true")
p.add_argument("--late-s", type=float, default=0.0)
args = p.parse_args()
if os.environ.get("LOCAL_RANK") == "1":
    threading.Event().wait(args.late_s)  # a slow import: nothing to wait for but time

state = ElasticState(checkpoint=args.checkpoint, model=torch.nn.Linear(4, 1), step=0)


def train(s: ElasticState) -> None:
    print("training started", flush=True)
    while s.step < 10:
        s.step += 1
        s.commit(durable=s.step % 5 == 0)


if args.skip_run:
    print("built the state; not calling run()", flush=True)
else:
    state.run(train)
