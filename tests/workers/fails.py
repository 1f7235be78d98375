"""A worker that fails on purpose, for the launcher's crash messages.

``--when import``: raises before it builds its ElasticState (it never joins the job).
``--when train``: joins, trains and commits, then raises its own ValueError inside the training
function (``run()`` leaves the job and re-raises it).
"""

import argparse

p = argparse.ArgumentParser()
p.add_argument("--when", choices=("import", "train"), required=True)
args = p.parse_args()

if args.when == "import":
    raise ValueError("the script failed before it joined (on purpose)")

import torch  # noqa: E402

from elastic import ElasticState  # noqa: E402

state = ElasticState(model=torch.nn.Linear(4, 1), step=0)


def train(s: ElasticState) -> None:
    while s.step < 10:
        s.step += 1
        s.commit()
    raise ValueError("the script failed after it joined and trained (on purpose)")


state.run(train)
