"""SIGINT/SIGTERM of a launcher (``elastic run``, and ``elastic etcd``): the first asks for a
graceful stop, a second one for an immediate kill, and either ends the launcher's waits at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

from elastic.foundation.signals import relay_signals


class StopSignal:
    """SIGINT/SIGTERM handling of the launcher: the first asks for a graceful stop, a second
    one for an immediate kill. ``wake`` is set on either, so that waits end at once.

    Args:
        wake: the Event to set on a signal.
        message: what the launcher says it does on a signal.
        again: what it says it does on a second one.
        shutdown: how long restoring the handlers waits for the relay thread
            (default: ``Timeouts.shutdown``).
    """

    def __init__(self, wake: threading.Event,
                 message: str = "asking the workers to leave (again to kill them now)",
                 shutdown: timedelta | None = None,
                 again: str = "asked again: killing the workers now") -> None:
        self.wake = wake
        self.message = message
        self.again = again
        self.shutdown = shutdown
        self.requested = threading.Event()
        self.forced = threading.Event()
        self.signum: signal.Signals | None = None

    def install(self) -> Callable[[], None]:
        """Installs the handlers (main thread only); returns a function that restores them.

        The handlers run on a relay thread (``elastic.foundation.signals``): setting ``wake``
        inside a real signal handler deadlocks when the main thread is in the middle of waiting on it.
        """
        return relay_signals((signal.SIGINT, signal.SIGTERM), self._on_signal, "elastic-signals",
                             self.shutdown)

    @property
    def exit_status(self) -> int:
        """The launcher's status after a stop: 130 for Ctrl-C (SIGINT), as torchrun and
        shells report it, however the workers ended; 0 for SIGTERM (a scheduler's polite stop),
        to which the caller adds whether every worker left gracefully."""
        return 128 + signal.SIGINT if self.signum == signal.SIGINT else 0

    def _on_signal(self, signum: signal.Signals) -> None:
        message = self.message
        if self.requested.is_set():
            self.forced.set()
            message = self.again
        self.signum = self.signum or signum
        self.requested.set()
        self.wake.set()
        try:
            print(f"elastic: signal {signum.name}: {message}", file=sys.stderr, flush=True)
        except OSError:
            pass  # stderr is gone (a closed terminal or pipe); the stop goes ahead regardless
