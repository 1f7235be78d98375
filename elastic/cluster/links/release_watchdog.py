"""Notices a training thread that stays blocked after its round was released.

Releasing a round wakes every collective, and the training thread then drops the round on its
way to the next one. gloo has a race in which the thread is not woken: a send that gloo had
queued but not yet written when its connection closed stays in ``waitSend`` until the
collective timeout (30 minutes by default), while the rest of the job waits for this member
(``--rejoin-timeout``) and then goes on without it. A step of the user's own that runs long
without any collective looks the same from here.

``ReleaseWatchdog`` is armed when a peer failure releases the round and disarmed when the
training thread drops it; when the grace (``--release-grace``) passes in between, it asks
``on_stuck`` for a verdict, from its own thread, and again after every further grace for as
long as the verdict is to wait. What to do is the caller's (``Cluster``: leave the job and
restart the worker in place, or wait while it alone holds its commit). A drop that comes while
a verdict is being reached waits for it: a thread must never go on into the next round while
its process is being replaced.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta


class ReleaseWatchdog:
    """Asks ``on_stuck(reason)`` for a verdict when a release is not followed by a drop
    within ``grace``.

    Args:
        grace: how long the training thread may take to drop a released round.
        on_stuck: called on the watchdog's thread with the release's reason; it either never
            returns (the process is replaced) or returns True to be asked again after another
            grace (False: not again for this release).
    """

    def __init__(self, grace: timedelta, on_stuck: Callable[[str], bool]) -> None:
        self.grace = grace
        self._on_stuck = on_stuck
        self._changed = threading.Condition()
        self._timer: threading.Timer | None = None
        self._deciding = False  # on_stuck runs: a drop waits for its verdict

    def arm(self, reason: str) -> None:
        """Starts the grace (the round was released); a second release changes nothing."""
        with self._changed:
            if self._timer is None and not self._deciding:
                self._start(reason)

    def _start(self, reason: str) -> None:
        self._timer = threading.Timer(self.grace.total_seconds(), self._fire, (reason,))
        self._timer.name = "elastic-release-watchdog"
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        """The training thread dropped the round: nothing is stuck. A verdict being reached
        is waited for (its etcd requests are bounded by their own deadline); one that replaces
        the process never lets this return."""
        with self._changed:
            self._changed.wait_for(lambda: not self._deciding)
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    @property
    def is_armed(self) -> bool:
        with self._changed:
            return self._timer is not None or self._deciding

    def _fire(self, reason: str) -> None:
        with self._changed:
            if self._timer is not threading.current_thread():
                return  # disarmed meanwhile
            self._timer, self._deciding = None, True
        again = False
        try:
            again = self._on_stuck(reason)
        finally:
            with self._changed:
                self._deciding = False
                if again:
                    self._start(reason)
                self._changed.notify_all()
