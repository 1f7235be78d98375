"""The imports a sharded worker's first FSDP2 formation would make, made ahead on a thread.

Owns importing ``torch._dynamo`` (what FSDP2's first ``fully_shard`` in a process imports) while
the worker registers, so that registering is not delayed (workers that start together still
form one first round), and waiting for it before ``run`` freezes the collector's generations:
then the full collections (``settle``'s at every formation, the collector's own in training)
never scan its objects, and a joiner into a running job asks to join only once it is done, so
the running ranks never wait for it inside a formation.
"""

from __future__ import annotations

import importlib
import logging
import threading
from datetime import timedelta

log = logging.getLogger(__name__)


class AheadImports:
    """One import of ``torch._dynamo`` on a thread: ``start`` it, then ``wait`` for it."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=importlib.import_module,
                                        args=("torch._dynamo",),
                                        name="elastic-fsdp-imports", daemon=True)
        self._thread.start()

    def wait(self, timeout: timedelta) -> None:
        """Waits ``timeout`` at most; past it, ``parallelize`` waits instead (Python's import
        lock)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join(timeout.total_seconds())
        if thread.is_alive():
            log.info("importing torch._dynamo took over %.0f s; going on without it",
                     timeout.total_seconds())
