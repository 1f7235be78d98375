"""The job's story on the console: one ``elastic:`` line per event a person cares about.

A listener on a worker's ``EventLog`` that, on rank 0 only, turns a formation (start, a join,
a failure), a resume from a checkpoint and a durable checkpoint into one line each, so that one
place tells the story (deaths are told by the launcher that saw them). Under ``elastic run`` the
line is marked (``MARK``) so that the launcher shows it without a worker prefix, whatever
``--local-ranks-filter`` shows; ``--quiet`` (``ELASTIC_CONSOLE=quiet``) hides the lines. Owns the
wording only: the facts come from the events.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import IO, Any

from elastic.foundation.settings import CONSOLE_MODES

MARK = "\x1e"  # a worker's story line under `elastic run`: shown by the launcher unprefixed
PLAIN, LAUNCHER, QUIET = CONSOLE_MODES


class ConsoleStory:
    """Prints the story lines of one worker's events (``EventLog.listen``).

    Args:
        mode: ``plain`` (print ``elastic: ...``), ``launcher`` (print them marked for the
            launcher) or ``quiet`` (print nothing).
        out: the stream written to (stderr).
    """

    def __init__(self, mode: str = PLAIN, out: IO[str] | None = None) -> None:
        if mode not in CONSOLE_MODES:
            raise ValueError(f"console mode ({mode!r}) must be one of {', '.join(CONSOLE_MODES)}.")
        self.mode = mode
        self._out = out
        self._world: int | None = None  # the world of this worker's last formation
        self._loaded: Mapping[str, Any] | None = None  # a checkpoint read in this formation

    def __call__(self, record: Mapping[str, Any]) -> None:
        line = self.line(record)
        if line is None or self.mode == QUIET:
            return
        out = self._out or sys.stderr
        try:
            out.write(f"{MARK if self.mode == LAUNCHER else ''}elastic: {line}\n")
            out.flush()
        except (OSError, ValueError):
            pass  # the console is gone; the event log still has it

    def line(self, record: Mapping[str, Any]) -> str | None:
        """The story line of one event record, or None (not rank 0's, or not a story event)."""
        event = record.get("event")
        if event == "checkpoint_loaded":
            self._loaded = record
            return None
        if event == "resumed":
            previous, self._world = self._world, record.get("world_size")
            loaded, self._loaded = self._loaded, None
            if record.get("rank") != 0:
                return None
            return formation_line(record, previous, loaded)
        if event == "checkpoint_written" and record.get("rank") == 0:
            return written_line(record)
        return None


def formation_line(record: Mapping[str, Any], previous: int | None,
                   loaded: Mapping[str, Any] | None) -> str:
    """What a formation did: a start, a resume, a join or a failure, with the world change."""
    world = record.get("world_size")
    took = f"{float(record.get('recovery_s', 0.0)):.2f} s"
    change = f"world {previous} -> {world}" if previous not in (None, world) else f"world {world}"
    reason = record.get("reason")
    if loaded is not None:
        return (f"resumed from {loaded.get('url')} at epoch {loaded.get('epoch')}, "
                f"{_at_step(record, loaded.get('version'))} (version {loaded.get('version')}, "
                f"world {world})")
    if reason == "failure":
        return f"re-formed after a failure: {change} in {took}, {_rollback(record)}"
    if reason == "change":
        grew = previous is not None and world is not None and world > previous
        what = "joined" if grew or previous is None else "left"
        return f"{what}: {change} (running workers paused {took})"
    if reason == "start":
        return f"formed: {change} in {took} (round {record.get('round')})"
    return f"re-formed ({reason}): {change} in {took}"


def _at_step(record: Mapping[str, Any], version: Any) -> str:
    step = record.get("step")
    return f"step {step}" if step is not None else f"commit {version}"


def _rollback(record: Mapping[str, Any]) -> str:
    step, lost = record.get("step"), record.get("rolled_back")
    if step is None:
        return f"rolled back to commit {record.get('version')}"
    if lost:
        return f"rolled back {lost} step{'s' if lost != 1 else ''} to step {step}"
    return f"nothing rolled back (step {step})"


def written_line(record: Mapping[str, Any]) -> str:
    """A durable checkpoint: its version, size and how long the write took."""
    size = record.get("bytes")
    sized = f"{_bytes(size)}, " if isinstance(size, int) else ""
    return (f"durable checkpoint v{record.get('version')} written ({sized}"
            f"{float(record.get('write_s', 0.0)):.1f} s)")


def _bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")
