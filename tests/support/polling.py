"""The one bounded poll of the tests, for conditions no event reaches us for.

Progress files written by other processes, a server of another process becoming healthy: there
is nothing to wait on in this process, so the condition is looked at every ``PACE_S`` until a
deadline. Everything that can wait on an event, a watch or a process does that instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

PACE_S = 0.05


def poll_until(condition: Callable[[], object], timeout_s: float) -> bool:
    """Returns True as soon as ``condition()`` is truthy, False once ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    pace = threading.Event()  # never set: its wait() is a bounded pause between looks
    while not condition():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        pace.wait(min(PACE_S, left))
    return True
