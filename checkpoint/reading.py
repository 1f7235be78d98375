"""Reading one replicated checkpoint: its format, its checksums, and its decoding.

Owns what a ``torch.save`` checkpoint decodes into (``LoadedCheckpoint``) and the refusal of
formats this reader does not decode (a sharded checkpoint is read by ``ShardedCheckpoints``).
Also the fallback from a newest checkpoint that does not read to an older one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from elastic.checkpoint.backend import Storage
from elastic.checkpoint.errors import (CheckpointCorruptError, CheckpointIncompatibleError,
                                       CheckpointNotFoundError, CheckpointReadError,
                                       CheckpointStorageError)
from elastic.checkpoint.listing import CheckpointRef
from elastic.checkpoint.manifest import DCP_FORMAT, PAYLOAD_FORMAT, step_dir_name
from elastic.checkpoint.payload import PAYLOAD_NAME, payload_name_in, read_payload

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What ``CheckpointStore.load`` returns.

    Attributes:
        ref: The checkpoint that was read.
        state_dict: The decoded state (tensors on the CPU).
        metadata: The metadata saved with it.
    """

    ref: CheckpointRef
    state_dict: Any
    metadata: Mapping[str, Any]


def read_checkpoint(storage: Storage, ref: CheckpointRef) -> LoadedCheckpoint:
    """Reads ``ref``, verifying its checksum; never runs code from the file.

    Raises:
        CheckpointIncompatibleError: ``ref`` is a sharded checkpoint.
        CheckpointCorruptError: ``ref`` does not verify or decode.
        CheckpointUnsafeError: its payload would run code.
        CheckpointReadError: the storage failed while reading it.
    """
    step_dir = storage.join(step_dir_name(ref.step))
    if ref.manifest.payload_format == DCP_FORMAT:
        raise CheckpointIncompatibleError(
            f"checkpoint {ref.url} is sharded (written by every rank of an FSDP job); "
            "load it with checkpoint.ShardedCheckpoints.load, or "
            "torch.distributed.checkpoint.load.")
    name = payload_name_in(ref.manifest.files)
    if ref.manifest.payload_format != PAYLOAD_FORMAT or name is None:
        raise CheckpointCorruptError(
            f"checkpoint {ref.url} has payload format {ref.manifest.payload_format!r} with "
            f"files {sorted(ref.manifest.files)}; this version reads 'torch.save' only.")
    try:
        state = read_payload(storage, f"{step_dir}/{name}", ref.manifest.files[name])
    except (OSError, CheckpointStorageError) as exc:
        raise CheckpointReadError(
            f"reading checkpoint {ref.url} failed: {exc!r}. Check that the storage is "
            "reachable; the checkpoint itself may be intact.") from exc
    return LoadedCheckpoint(ref=ref, state_dict=state, metadata=ref.manifest.metadata)


def newest_readable(candidates: list[CheckpointRef], read: Callable[[CheckpointRef], T],
                    skipped: list[str], url: str) -> T:
    """``read`` of the newest of ``candidates`` that reads, skipping (with a warning) newer ones
    that are corrupt. A newer one that the storage failed to read is never skipped: it may be
    intact, and resuming from an older one would lose its steps for good (a later save of the
    same steps is refused, and retention then prunes it).

    Args:
        candidates: complete checkpoints, oldest first.
        read: reads one; raises ``CheckpointCorruptError`` or ``CheckpointReadError``.
        skipped: why newer directories were already skipped (for the final message).
        url: the root URL (for the final message).

    Raises:
        CheckpointNotFoundError: none reads: every one is corrupt, or there is none.
        CheckpointReadError: the storage failed while reading the newest one not corrupt.
    """
    for candidate in reversed(candidates):
        try:
            return read(candidate)
        except CheckpointCorruptError as exc:
            logger.warning("skipping checkpoint %s: %s; falling back to an older one",
                           candidate.url, exc)
            skipped.append(f"{candidate.url}: {exc}")
    raise CheckpointNotFoundError(
        f"no readable checkpoint under {url}"
        + (f"; skipped: {'; '.join(skipped)}" if skipped else "")
        + ". Start from scratch, or point the store at the right URL.")


def read_sharded_payload(storage: Storage, ref: CheckpointRef) -> LoadedCheckpoint:
    """Reads only rank 0's payload of the sharded checkpoint ``ref`` (its small state; the
    shards are loaded collectively by ``ShardedCheckpoints.load``), verifying its checksum.

    Raises:
        CheckpointCorruptError: ``ref`` is not sharded, has no payload, or it does not verify.
        CheckpointReadError: the storage failed while reading it.
    """
    entry = ref.manifest.files.get(PAYLOAD_NAME)
    if ref.manifest.payload_format != DCP_FORMAT or entry is None:
        raise CheckpointCorruptError(f"checkpoint {ref.url} is not a sharded checkpoint with a "
                                     f"{PAYLOAD_NAME} (format {ref.manifest.payload_format!r}).")
    try:
        state = read_payload(storage, storage.join(step_dir_name(ref.step), PAYLOAD_NAME), entry)
    except (OSError, CheckpointStorageError) as exc:
        raise CheckpointReadError(
            f"reading checkpoint {ref.url} failed: {exc!r}. Check that the storage is "
            "reachable; the checkpoint itself may be intact.") from exc
    return LoadedCheckpoint(ref=ref, state_dict=state, metadata=ref.manifest.metadata)
