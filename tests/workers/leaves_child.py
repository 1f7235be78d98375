"""A worker that leaves a child holding its stdout and stderr, then is SIGKILLed.

``leaves_child.py DIR``: joins, commits a few steps, starts a shell in the background that
inherits both output pipes (its pid in ``DIR/child.pid``; it prints one line once something is
written to the FIFO ``DIR/go``), writes the time to ``DIR/killed`` and kills itself. A
replacement (``DIR/killed`` exists) trains and returns.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch

from elastic import ElasticState

out = Path(sys.argv[1])
state = ElasticState(model=torch.nn.Linear(4, 1), step=0)


def train(s: ElasticState) -> None:
    while s.step < 3:
        s.step += 1
        s.commit()
    killed = out / "killed"
    if killed.exists():
        return
    os.system(f"sh -c 'read line < {out}/go; echo child-output-after-death; exec sleep 60' & "
              f"echo $! > {out}/child.pid")
    killed.write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


state.run(train)
