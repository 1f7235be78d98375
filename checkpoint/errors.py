"""Typed errors of the checkpoint package.

Every failure that leaves ``checkpoint`` is a :class:`CheckpointError`; third-party errors
(fsspec, torch, the object store's client) are translated at the boundary with their cause
chained. This module must not import anything from the rest of the project.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by the checkpoint package."""


class CheckpointNotFoundError(CheckpointError):
    """No valid checkpoint exists where one was asked for."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint exists but its files do not match its manifest or cannot be decoded."""


class CheckpointUnsafeError(CheckpointCorruptError):
    """A payload asked to run code (or build arbitrary objects) while loading; it was refused."""


class CheckpointIncompatibleError(CheckpointError):
    """A loaded state does not fit the live state (missing/unknown key or a shape mismatch)."""


class CheckpointBackendError(CheckpointError):
    """The URL's scheme has no usable fsspec implementation (unknown, or its package is missing)."""


class CheckpointFencedError(CheckpointError):
    """A writer from an older generation tried to publish after a newer generation did.

    Attributes:
        newer: the newer generation's checkpoint (a ``CheckpointRef``) when the store refused
            the write; None when the writer's own check refused it (its lease was gone).
    """

    def __init__(self, message: str, newer: object = None) -> None:
        super().__init__(message)
        self.newer = newer


class CheckpointRaceError(CheckpointFencedError):
    """Another writer published the same step first (a conditional create lost the race): its
    checkpoint stands untouched, this one was not published. ``newer`` is the winner's
    checkpoint when it could be read."""


class CheckpointHeldError(CheckpointError):
    """Another job holds the checkpoint URL (its claim's heartbeat is fresh).

    Attributes:
        holder: its record (a ``holder.Holder``).
    """

    def __init__(self, message: str, holder: object = None) -> None:
        super().__init__(message)
        self.holder = holder


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed part-way; the previous checkpoints are untouched."""


class CheckpointCredentialsError(CheckpointError):
    """The object store refused us for lack of credentials (none found, or incomplete)."""


class CheckpointStorageError(CheckpointError):
    """A storage call failed with the store's own error (after the retries of transient ones)."""


class CheckpointReadError(CheckpointError):
    """The storage failed while a checkpoint's files were read (after retries); unlike a corrupt
    checkpoint, it may read fine once the storage answers again."""


class CheckpointLocationError(CheckpointError):
    """The checkpoint location cannot be written (permissions, a file in the way, no bucket)."""
