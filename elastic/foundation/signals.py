"""Signal handling that never takes a lock inside the handler.

A Python signal handler runs in the main thread between two bytecodes, possibly while that very
thread holds a lock the handler would take again: an Event's condition in the middle of
``wait``/``clear``, stderr's buffer in the middle of a write. Those locks are not reentrant, so
such a handler deadlocks the process with itself (seen once in CI: a launcher that never
answered a second Ctrl-C). Here the handler only writes the signal's number to a pipe; a relay
thread reads it and runs the callback, where setting Events, logging and printing are safe.
A process forked from the relay's owner (a ``DataLoader`` worker) inherits the handler but not
the thread, and shares the pipe: there the signal is handled as if no relay were installed.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta

from elastic.foundation.timeouts import Timeouts

__all__ = ["LeaveRequest", "relay_signals"]


class LeaveRequest(threading.Event):
    """An Event that a signal handler can mark without a lock: ``is_set`` and ``wait`` see the
    mark at once, on the main thread too, before the relay thread gets to ``set`` it."""

    def __init__(self) -> None:
        super().__init__()
        self._marked = False

    def mark(self) -> None:
        """Records the request with one attribute store: safe inside a signal handler."""
        self._marked = True

    def is_set(self) -> bool:
        return self._marked or super().is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return True if self._marked else super().wait(timeout)


def relay_signals(signals: Iterable[signal.Signals], callback: Callable[[signal.Signals], None],
                  name: str, join_timeout: timedelta | None = None,
                  mark: LeaveRequest | None = None) -> Callable[[], None]:
    """Routes ``signals`` to ``callback``, called on a thread named ``name`` in arrival order.

    Only the main thread can install signal handlers; from any other thread this does nothing.

    Args:
        signals: the signals to route.
        callback: called with each signal, on the relay thread.
        name: the relay thread's name.
        join_timeout: how long restoring waits for the relay thread to finish its last callback
            (default: ``Timeouts.shutdown``).
        mark: marked inside the handler itself, so that the main thread sees the signal as
            soon as the handler ran, not only once the relay thread ran the callback.

    Returns:
        A function that puts the previous handlers back and ends the relay thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    join_s = (join_timeout or Timeouts().shutdown).total_seconds()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    open_fd = [write_fd]  # emptied by restore(); read by the handler without a lock
    owner = os.getpid()
    previous: dict[signal.Signals, object] = {}

    def on_signal(signum: int, frame: object) -> None:
        if os.getpid() != owner:  # a forked child (a DataLoader worker): not ours to relay
            _as_before_in_child(signal.Signals(signum), previous, frame)
            return
        if mark is not None:
            mark.mark()
        if open_fd:
            try:
                os.write(open_fd[0], bytes([signum]))
            except BlockingIOError:
                pass  # the pipe holds thousands of unread signals; one more adds nothing

    def relay() -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(64):  # b"" once restore() closed the writing end
                for signum in chunk:
                    callback(signal.Signals(signum))

    thread = threading.Thread(target=relay, name=name, daemon=True)
    thread.start()
    previous.update({sig: signal.signal(sig, on_signal) for sig in signals})

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if open_fd:
            os.close(open_fd.pop())
        if thread is not threading.current_thread():
            thread.join(timeout=join_s)

    return restore


def _as_before_in_child(sig: signal.Signals, previous: dict[signal.Signals, object],
                        frame: object) -> None:
    """Handles ``sig`` in a process forked from the relay's owner as if the relay had never
    been installed: the child has no relay thread, and the pipe would carry the signal to the
    owner (a DataLoader worker terminated at shutdown would make its trainer leave the job)."""
    handler = previous.get(sig, signal.SIG_DFL)
    signal.signal(sig, handler)  # type: ignore[arg-type]
    if handler == signal.SIG_DFL:
        os.kill(os.getpid(), sig)  # the default action: a SIGTERM ends the child
    elif callable(handler):
        handler(sig, frame)  # e.g. SIGINT's default raises KeyboardInterrupt
