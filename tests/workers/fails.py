"""A worker that fails on purpose, for the launcher's crash messages.

``--when import``: raises before it builds its ElasticState (it never joins the job).
``--when first-step``: joins, then raises in its first step, before any commit (the same way
on every restart: a bug a restart cannot fix).
``--when train``: joins, trains and commits, then raises its own ValueError inside the training
function (``run()`` leaves the job and re-raises it).
"""

import argparse

p = argparse.ArgumentParser()
p.add_argument("--when", choices=("import", "first-step", "train"), required=True)
args = p.parse_args()

if args.when == "import":
    raise ValueError("the script failed before it joined (on purpose)")

import torch  # noqa: E402

from elastic import ElasticState  # noqa: E402

state = ElasticState(model=torch.nn.Linear(4, 1), step=0)


def train(s: ElasticState) -> None:
    if args.when == "first-step":
        raise ValueError("the script failed in its first step (on purpose)")
    while s.step < 10:
        s.step += 1
        s.commit()
    raise ValueError("the script failed after it joined and trained (on purpose)")


state.run(train)
