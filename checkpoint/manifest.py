"""The manifest: the small JSON file whose presence makes a checkpoint exist.

A checkpoint directory ``{url}/{step:012d}/`` holds its payload files and, written last,
``manifest.json`` with the format version, the training coordinates (step, epoch, world size,
generation), the creation time, the user's metadata, and each file's size and sha256. This module
encodes, decodes and validates manifests; it does no I/O.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic.checkpoint.errors import CheckpointCorruptError, CheckpointIncompatibleError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
#: How the payload is encoded: one ``torch.save`` archive (replicated state) ...
PAYLOAD_FORMAT = "torch.save"
#: ... or a ``torch.distributed.checkpoint`` directory, every rank's shards (sharded state).
DCP_FORMAT = "torch.distributed.checkpoint"
MAX_STEP = 10**12 - 1
_INT_FIELDS = ("epoch", "world_size", "generation")


def step_dir_name(step: int) -> str:
    """Returns the directory name of ``step`` (12 digits, so names sort like steps)."""
    return f"{step:012d}"


@dataclass(frozen=True)
class FileEntry:
    """One payload file as the manifest records it.

    Attributes:
        size: Length in bytes.
        sha256: Hex digest of the content.
    """

    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """The decoded ``manifest.json`` of one checkpoint.

    Attributes:
        step: Optimizer step the checkpoint was taken at.
        epoch: Data epoch, if the writer gave one.
        world_size: Number of workers that wrote it, if given.
        generation: Membership generation of the writer (the fencing token), if given.
        created: Creation time, seconds since the Unix epoch.
        metadata: The writer's metadata, JSON values only.
        files: Payload file name to its size and checksum.
        payload_format: How the payload is encoded.
        format_version: Version of this manifest layout.
    """

    step: int
    epoch: int | None
    world_size: int | None
    generation: int | None
    metadata: Mapping[str, Any]
    files: Mapping[str, FileEntry]
    created: float = field(default_factory=time.time)
    payload_format: str = PAYLOAD_FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        """Encodes the manifest as UTF-8 JSON."""
        doc = {
            "format_version": self.format_version,
            "payload_format": self.payload_format,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "generation": self.generation,
            "created": self.created,
            "metadata": dict(self.metadata),
            "files": {n: {"size": e.size, "sha256": e.sha256} for n, e in self.files.items()},
        }
        return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Decodes and validates a manifest.

        Raises:
            CheckpointCorruptError: The bytes are not a valid manifest.
            CheckpointIncompatibleError: The manifest is from a newer format version.
        """
        try:
            doc = json.loads(data)
            version = doc["format_version"]
            if not isinstance(version, int) or version > FORMAT_VERSION:
                raise CheckpointIncompatibleError(
                    f"manifest format_version {version!r} is newer than this library reads "
                    f"({FORMAT_VERSION}); upgrade elastic-trainer to load it.")
            files = {str(n): FileEntry(int(e["size"]), str(e["sha256"]))
                     for n, e in doc["files"].items()}
            return cls(step=_int(doc["step"]), epoch=_opt_int(doc.get("epoch")),
                       world_size=_opt_int(doc.get("world_size")),
                       generation=_opt_int(doc.get("generation")),
                       metadata=dict(doc.get("metadata") or {}), files=files,
                       created=float(doc["created"]), payload_format=str(doc["payload_format"]),
                       format_version=version)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointCorruptError(f"manifest is not valid: {exc!r}") from exc


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an int, got {value!r}")
    return value


def _opt_int(value: Any) -> int | None:
    return None if value is None else _int(value)


def checked_metadata(step: int, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validates a writer's metadata for ``step`` and returns a JSON-clean copy.

    Args:
        step: The step being saved.
        metadata: Optional mapping; ``step``, ``epoch``, ``world_size`` and ``generation``
            must be ints when present, everything else must be JSON-serialisable.

    Returns:
        A plain dict (round-tripped through JSON), with ``step`` filled in.

    Raises:
        ValueError: A field has the wrong type, ``step`` disagrees, or a value is not JSON.
    """
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step ({step!r}) must be an int in [0, {MAX_STEP}].")
    meta = dict(metadata or {})
    if meta.setdefault("step", step) != step:
        raise ValueError(f"metadata step ({meta['step']!r}) differs from the saved step ({step}).")
    for name in _INT_FIELDS:
        value = meta.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"metadata {name} ({value!r}) must be an int.")
    try:
        return json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must hold JSON values only (str keys, no NaN): {exc}") from exc

