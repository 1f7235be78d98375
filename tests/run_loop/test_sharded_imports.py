"""A sharded worker's imports ahead of its first formation: made on a thread while it
registers, and done before ``run``'s ``gc.freeze``, so that the collector's permanent
generation holds them and the full collection of every formation does not scan them."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import gc, sys
from datetime import timedelta
from elastic.sharded import ShardedRuntime
assert "torch._dynamo" not in sys.modules, "imported already: the probe proves nothing"
runtime = ShardedRuntime(lambda mesh: {}, None, 1, timedelta(seconds=5), timedelta(seconds=1))
runtime.prepare()
runtime.wait_prepared(timedelta(seconds=60))
gc.freeze()  # what run() does next
import torch._dynamo.eval_frame as module
print(id(vars(module)) in {id(o) for o in gc.get_objects()})
"""


def test_the_imports_made_ahead_are_frozen_with_everything_before_the_run_loop():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"  # in the permanent generation: never scanned
