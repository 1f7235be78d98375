"""Durable checkpoints on any fsspec URL: layout, manifest, checksums, retention, fencing.

Knows nothing of etcd, and never imports ``state`` or ``elastic``; sharded checkpoints
(``ShardedCheckpoints``) are written and read collectively over the process group given.

Example:
    >>> store = CheckpointStore("s3://bucket/run-7", keep=3)
    >>> future = store.save_async(step, {"model": model.state_dict()}, {"epoch": 2})
    >>> loaded = store.load()   # newest checkpoint that verifies
"""

from elastic.checkpoint.compat import check_compatible
from elastic.checkpoint.errors import (
    CheckpointBackendError,
    CheckpointCorruptError,
    CheckpointCredentialsError,
    CheckpointError,
    CheckpointFencedError,
    CheckpointHeldError,
    CheckpointIncompatibleError,
    CheckpointLocationError,
    CheckpointNotFoundError,
    CheckpointRaceError,
    CheckpointReadError,
    CheckpointStorageError,
    CheckpointUnsafeError,
    CheckpointWriteError,
)
from elastic.checkpoint.holder import Holder, UrlClaim
from elastic.checkpoint.listing import CheckpointRef
from elastic.checkpoint.probe import check_writable
from elastic.checkpoint.manifest import FORMAT_VERSION, MANIFEST_NAME, FileEntry, Manifest
from elastic.checkpoint.reading import LoadedCheckpoint
from elastic.checkpoint.sharded import ShardedCheckpoints
from elastic.checkpoint.store import CheckpointStore

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CheckpointBackendError",
    "CheckpointCorruptError",
    "CheckpointCredentialsError",
    "CheckpointError",
    "CheckpointFencedError",
    "CheckpointHeldError",
    "CheckpointIncompatibleError",
    "CheckpointLocationError",
    "CheckpointNotFoundError",
    "CheckpointRaceError",
    "CheckpointRef",
    "CheckpointReadError",
    "CheckpointStorageError",
    "CheckpointStore",
    "CheckpointUnsafeError",
    "CheckpointWriteError",
    "FileEntry",
    "Holder",
    "LoadedCheckpoint",
    "Manifest",
    "ShardedCheckpoints",
    "UrlClaim",
    "check_compatible",
    "check_writable",
]
