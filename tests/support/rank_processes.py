"""Where the tests' rank processes come from: a fork server that imported torch once.

A spawned rank is a fresh interpreter that imports torch (seconds of CPU) before it does
anything; the suite starts dozens. Forked from the fork server instead, a rank is still a clean
process (not a copy of pytest, nothing of a test's state in it, its target's module imported
in it) whose torch is already imported, as a worker forked from ``elastic run``'s warm-start
template is. The server starts at the first rank of the session and ends with pytest.
"""

from __future__ import annotations

import multiprocessing.context

import torch.multiprocessing as mp

# Imported by the server before it forks: torch only (no thread, no gRPC channel, nothing a
# fork would copy half-made).
PRELOAD = ["torch", "torch.distributed"]


def rank_context() -> multiprocessing.context.BaseContext:
    """The context to make rank processes (``Process``, ``Queue``) with."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, the first time only
    return ctx
