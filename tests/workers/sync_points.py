"""Test-only synchronisation for the worker scripts (start together; hold until a join).

Workers started together import torch at different speeds on a loaded machine; without a start
barrier the first round could form before the last one registered and a fault planned for
"world 3, step 12" would fire in world 2. These points make the scenarios deterministic.
"""

from __future__ import annotations

import os
from pathlib import Path

from elastic import MembershipChangedInterrupt
from tests.support.polling import poll_until

_held: list[bool] = []  # this process already held until a change (hold_until_change)


def wait_for_peers(out: Path, index: int, timeout_s: float = 120.0) -> None:
    """With ``START_BARRIER=N``: announces this worker and waits until N workers announced."""
    count = int(os.environ.get("START_BARRIER", "0"))
    if not count:
        return
    (out / f"ready-{index}").touch()
    if not poll_until(lambda: len(list(out.glob("ready-*"))) >= count, timeout_s):
        raise TimeoutError(f"only {len(list(out.glob('ready-*')))} of {count} workers started")


def hold_until_world(state, world: int, timeout_s: float = 90.0) -> None:
    """Keeps agreeing on membership until the world reaches ``world`` (a joiner is admitted).

    ``check_membership`` raises ``MembershipChangedInterrupt`` once the joiner asked to join;
    the run loop then re-forms with it.
    """
    def admitted() -> bool:
        state.check_membership()  # raises MembershipChangedInterrupt once the joiner asked
        return state.world_size >= world

    if not poll_until(admitted, timeout_s):
        raise TimeoutError(f"the world did not reach {world} within {timeout_s} s")


def hold_until_change(state, out: Path, index: int, timeout_s: float = 90.0) -> None:
    """Keeps agreeing on membership until the first change is agreed, once per process.

    Writes ``holding-{index}`` first, so that a test makes its change (starts a joiner, plants
    a join request) only once every worker holds. The change is agreed inside
    ``check_membership``, which raises ``MembershipChangedInterrupt``; later calls return at
    once, whatever the world.
    """
    if _held:
        return
    (out / f"holding-{index}").touch()

    def agreed() -> bool:
        try:
            state.check_membership()
        except MembershipChangedInterrupt:
            _held.append(True)
            raise
        return False

    if not poll_until(agreed, timeout_s):
        raise TimeoutError(f"no membership change was agreed within {timeout_s} s")


def hold_until_join_seen(state, out: Path, index: int, timeout_s: float = 150.0) -> None:
    """Writes ``holding-{index}``, then waits until this worker's membership watch saw a join
    (the test writes ``join-started`` and starts a joiner once every worker holds), so that
    the very next agreement, the commit that follows, agrees on it; once the joiner started,
    returns at once. Reads the watch's own flag: the library has no public probe for a
    pending join, and only a test needs one."""
    if (out / "join-started").exists():
        return
    (out / f"holding-{index}").touch()
    if not state._cluster.tracker.pending.wait(timeout_s):
        raise TimeoutError(f"no join was seen within {timeout_s} s")
