"""Starts one process per rank (from the fork server of ``tests.support.rank_processes``) that
reports a tuple through a queue; kills them all in the end."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.rank_processes import rank_context


def spawn_ranks(target: Callable[..., None], world: int, *args: Any, reporting: int | None = None,
                timeout_s: float = 90) -> dict[int, tuple]:
    """Runs ``target(rank, *args, results)`` in ``world`` processes.

    Each rank puts ``(rank, *what)`` on ``results``. Returns ``{rank: what}`` once ``reporting``
    ranks (default: all) reported; fails the test when they have not within ``timeout_s``.
    """
    ctx = rank_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, *args, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    got: dict[int, tuple] = {}
    try:
        for _ in range(world if reporting is None else reporting):
            rank, *what = results.get(timeout=timeout_s)
            got[rank] = tuple(what)
    except queue.Empty:
        pytest.fail(f"ranks reported {got} within {timeout_s:.0f} s, expected "
                    f"{world if reporting is None else reporting}")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    return got
