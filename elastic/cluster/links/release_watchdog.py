"""Notices a training thread that stays blocked after its round was released.

Releasing a round wakes every collective, and the training thread then drops the round on its
way to the next one. gloo has a race in which the thread is not woken: a send that gloo had
queued but not yet written when its connection closed stays in ``waitSend`` until the
collective timeout (30 minutes by default), while the rest of the job waits for this member
(``--rejoin-timeout``) and then goes on without it. A step of the user's own that runs long
without any collective looks the same from here.

``ReleaseWatchdog`` is armed when a peer failure releases the round and disarmed when the
training thread drops it; when the grace (``--release-grace``) passes in between, it calls
``on_stuck`` once, from its own thread. What to do then is the caller's (``Cluster``: leave the
job and restart the worker in place).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta


class ReleaseWatchdog:
    """Calls ``on_stuck(reason)`` when a release is not followed by a drop within ``grace``.

    Args:
        grace: how long the training thread may take to drop a released round.
        on_stuck: called once per missed drop, on the watchdog's thread, with the release's
            reason.
    """

    def __init__(self, grace: timedelta, on_stuck: Callable[[str], None]) -> None:
        self.grace = grace
        self._on_stuck = on_stuck
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def arm(self, reason: str) -> None:
        """Starts the grace (the round was released); a second release changes nothing."""
        with self._lock:
            if self._timer is not None:
                return
            self._timer = threading.Timer(self.grace.total_seconds(), self._fire, (reason,))
            self._timer.name = "elastic-release-watchdog"
            self._timer.daemon = True
            self._timer.start()

    def disarm(self) -> None:
        """The training thread dropped the round: nothing is stuck."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    @property
    def is_armed(self) -> bool:
        with self._lock:
            return self._timer is not None

    def _fire(self, reason: str) -> None:
        with self._lock:
            if self._timer is not threading.current_thread():
                return  # disarmed meanwhile
            self._timer = None
        self._on_stuck(reason)
