"""Runs a function on every rank of a real gloo group of processes (from the fork server of
``tests.support.rank_processes``).

The group meets through a FileStore in a test's temporary directory (no store socket at all)
and gloo connects over loopback. Each rank's return value comes back through ``torch.save``
bytes; a rank that raises sends its traceback, and the test fails with it. Every process is
killed by PID in ``finally``, whatever happened.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.support.rank_processes import rank_context

__all__ = ["run_in_group", "GroupRunError"]


class GroupRunError(AssertionError):
    """A rank failed or did not report in time."""


def run_in_group(target: Callable[..., Any], world: int, store_dir: Path, *args: Any,
                 timeout_s: float = 120.0) -> dict[int, Any]:
    """Calls ``target(rank, world, *args)`` on ``world`` ranks of one gloo group.

    ``target`` must be a module-level function (it is pickled to the processes).

    Returns:
        ``{rank: target's return value}``.

    Raises:
        GroupRunError: a rank raised (its traceback is in the message) or none reported
            within ``timeout_s``.
    """
    ctx = rank_context()
    results = ctx.Queue()
    store = str(Path(store_dir) / "gloo-file-store")
    procs = [ctx.Process(target=_child, args=(target, rank, world, store, args, results))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        got: dict[int, Any] = {}
        for _ in range(world):
            try:
                rank, ok, body = results.get(timeout=timeout_s)
            except queue.Empty:
                raise GroupRunError(f"only ranks {sorted(got)} of {world} reported within "
                                    f"{timeout_s:.0f} s") from None
            if not ok:
                raise GroupRunError(f"rank {rank} failed:\n{body}")
            got[rank] = torch.load(io.BytesIO(body), weights_only=False)
        for proc in procs:
            proc.join(timeout=timeout_s)  # exiting torch is slow on a loaded machine
            if proc.exitcode != 0:
                raise GroupRunError(f"pid {proc.pid} exited with {proc.exitcode}")
        return got
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)


def _child(target: Callable[..., Any], rank: int, world: int, store: str, args: tuple,
           results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        value = target(rank, world, *args)
        body = io.BytesIO()
        torch.save(value, body)
        results.put((rank, True, body.getvalue()))
        if dist.is_initialized():  # unless the target destroyed it itself
            dist.destroy_process_group()
    except Exception:  # report any failure of the child to the parent test
        results.put((rank, False, traceback.format_exc()))
