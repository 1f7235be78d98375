"""What a sharded worker does ahead of its first FSDP2 formation, while it registers.

Owns two things that would otherwise happen inside that formation, while every running rank
waits for a joiner:

- importing ``torch._dynamo`` (what FSDP2's first ``fully_shard`` in a process imports), on a
  thread, so that registering is not delayed (workers that start together still form one first
  round); ``run`` waits for it before it freezes the collector's generations, so the full
  collections (``settle``'s at every formation, the collector's own in training) never scan
  its objects;
- touching the host memory the formation's reshard will fill (``warm_memory``), on the thread
  that calls ``run()`` and later allocates that memory, as much as ``ShardedRuntime`` asks for
  (from the job's ``bytes_per_rank`` record).

A joiner into a running job asks to join only once both are done.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from datetime import timedelta

from elastic.state.sharded.warm_memory import WarmMemory

log = logging.getLogger(__name__)


class AheadWork:
    """``start`` the imports, then ``wait`` for them and touch memory; ``release`` the memory
    once the formation is over."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._warm = WarmMemory()

    def start(self) -> None:
        self._thread = threading.Thread(target=importlib.import_module,
                                        args=("torch._dynamo",),
                                        name="elastic-fsdp-imports", daemon=True)
        self._thread.start()

    def wait(self, timeout: timedelta, touch_bytes: int = 0) -> tuple[int, float]:
        """Touches ``touch_bytes`` of heap memory and waits for the imports, both within
        ``timeout``; past it, ``parallelize`` waits for the imports instead (Python's import
        lock). Returns the bytes touched and the seconds that took."""
        started = time.monotonic()
        deadline = started + timeout.total_seconds()
        touched = self._warm.touch(touch_bytes, deadline)
        touch_s = time.monotonic() - started
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.info("importing torch._dynamo took over %.0f s; going on without it",
                         timeout.total_seconds())
        return touched, touch_s

    def release(self) -> None:
        """Lets the touched memory go back to the heap's ordinary use."""
        self._warm.release()
