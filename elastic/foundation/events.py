"""Structured events of one worker: JSON lines with a wall-clock time and durations.

One file per worker process (``{log_dir}/events-{member}.jsonl``), appended and flushed per event
so that a killed worker's file is complete up to its death. ``elastic report`` reads them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("elastic.events")


class EventLog:
    """Writes events to a JSON-lines file (or only to logging when ``log_dir`` is None).

    Args:
        log_dir: the directory of the event files; created if missing.
        worker: a name for this process, used in the file name.
    """

    def __init__(self, log_dir: str | None, worker: str) -> None:
        self.worker = worker
        self.path: Path | None = None
        self._lock = threading.Lock()
        self._fields: dict[str, Any] = {}
        self._listeners: list[Callable[[Mapping[str, Any]], None]] = []
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.path = Path(log_dir) / f"events-{worker}.jsonl"

    def bind(self, **fields: Any) -> None:
        """Adds fields (member, round, rank, world size) to every later event."""
        self._fields.update(fields)

    def listen(self, listener: Callable[[Mapping[str, Any]], None]) -> None:
        """Calls ``listener(record)`` with every later event (it must not raise)."""
        self._listeners.append(listener)

    def emit(self, event: str, **fields: Any) -> None:
        """Records one event; durations are given in seconds with a ``_s`` suffix."""
        record = {"t": time.time(), "event": event, "worker": self.worker, "pid": os.getpid(),
                  **self._fields, **fields}
        log.info("%s %s", event, {k: v for k, v in record.items() if k not in ("t", "worker")})
        if self.path is not None:
            line = json.dumps(record, default=str) + "\n"
            with self._lock, open(self.path, "a", encoding="utf-8") as out:
                out.write(line)
        for listener in self._listeners:  # after the file: what they tell is on record
            listener(record)


class Stopwatch:
    """Measures one duration: ``with Stopwatch() as sw: ...; sw.seconds``."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds = 0.0

    def __enter__(self) -> "Stopwatch":
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.monotonic() - self.started
