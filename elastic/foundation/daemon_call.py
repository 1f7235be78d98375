"""A call that may never return, run where it cannot hold the process: on a daemon thread.

Owns the one way the package waits, bounded, on a storage call that a hung mount or a
black-holed endpoint may never answer: the call runs on a daemon thread (left to end on its
own; it never holds the process at exit) and its caller waits for its result for a set time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

__all__ = ["DaemonCall"]


class DaemonCall:
    """``call()`` started on a daemon thread named ``name``; ``result`` waits for it."""

    def __init__(self, call: Callable[[], T], name: str) -> None:
        self._future: Future = Future()
        self.thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], T]) -> None:
        try:
            self._future.set_result(call())
        except Exception as exc:  # noqa: BLE001 (handed to the caller by result())
            self._future.set_exception(exc)

    def result(self, timeout_s: float) -> T:
        """The call's result, or what it raised.

        Raises:
            TimeoutError: the call did not end within ``timeout_s`` (it goes on, unwaited).
        """
        return self._future.result(timeout=timeout_s)
