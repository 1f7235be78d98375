"""Errors raised by the ``state`` package.

Owns the typed failures of committing, restoring, loading and synchronising training
state. Must not import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations


class StateError(Exception):
    """Base class of every error the ``state`` package raises on purpose."""


class StateKeyError(StateError, KeyError):
    """A state dict or payload has missing or unknown keys."""

    def __str__(self) -> str:
        # KeyError quotes its argument; a sentence reads better.
        return str(self.args[0]) if self.args else ""


class NoCommitError(StateError):
    """An operation needs a commit but ``commit()`` was never called (or was lost)."""


class SyncError(StateError):
    """Broadcasting the committed state over a process group failed or timed out."""


class PayloadFormatError(SyncError):
    """What a sync's source sent is not a payload this package wrote (malformed or hostile).

    Decoding stops at the first node of no known form and runs nothing; the source is not a
    worker of this job at this version, so the group re-forms without trusting it.
    """
