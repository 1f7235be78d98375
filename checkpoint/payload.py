"""The payload: snapshotting a state dict to host memory, encoding it, and decoding it safely.

The payload is one ``torch.save`` archive streamed through fsspec while its sha256 is computed
(hashing overlaps the write, so a save runs at disk speed), in a file whose name is the writer's
own (``new_payload_name``), so that two writers of one step never write the same file. Loading
reads it once in chunks, verifying the checksum on the way, and then uses
``torch.load(weights_only=True, mmap=True)``, which never runs code from the file, on the local
file or on an in-memory spool of the download.
This module does not decide where files go or which checkpoint is current.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

import torch

from elastic.checkpoint.backend import Storage, io_retry
from elastic.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointIncompatibleError,
    CheckpointUnsafeError,
)
from elastic.checkpoint.manifest import FileEntry

#: The payload's name in checkpoints written before names were a writer's own (still read), and
#: the name of a sharded checkpoint's rank-0 payload.
PAYLOAD_NAME = "state.pt"
_PAYLOAD_FILE = re.compile(r"state(\.[0-9a-f]{16})?\.pt")
_CHUNK = 8 << 20  # bytes handed to (or asked of) the filesystem per write (read) call
_OVERLAP_MIN = 256 << 10  # below this, hashing in parallel costs more than it saves
_WRITEBACK = 32 << 20  # local disks: push to disk every this many bytes
_PLAIN = (int, float, str, bool, type(None), bytes, complex, torch.dtype, torch.device, torch.Size)


def new_payload_name() -> str:
    """A payload name of one writer's own, ``state.<16 hex digits>.pt``: the loser of a race to
    publish a step then writes beside the winner's payload, never over it."""
    return f"state.{uuid.uuid4().hex[:16]}.pt"


def payload_name_in(files: Mapping[str, FileEntry]) -> str | None:
    """The payload file a replicated checkpoint's manifest names (``state.pt`` or
    ``state.<hex>.pt``), or None unless it names exactly one."""
    names = [name for name in files if _PAYLOAD_FILE.fullmatch(name)]
    return names[0] if len(names) == 1 else None


def _unstaged(path: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu")


def to_host(obj: Any, stage: Callable[[str, torch.Tensor], torch.Tensor] = _unstaged,
            path: str = "state_dict", memo: dict[int, torch.Tensor] | None = None) -> Any:
    """Returns ``obj`` with every tensor on the CPU, checking that it can be saved and loaded.

    Args:
        obj: Nested dicts/lists/tuples of tensors and plain values.
        stage: Turns one tensor (at ``path``) into its host version; the default moves it to
            the CPU without copying CPU tensors, :class:`HostStaging` copies.
        path: Where ``obj`` sits, for error messages and staging buffers.
        memo: Tensors already converted (keeps tied tensors tied).

    Returns:
        The converted structure (same container types).

    Raises:
        TypeError: A value is not a tensor, a plain value or a container of them.
    """
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = stage(path, obj)
        return memo[id(obj)]
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, Mapping):
        items = ((k, to_host(v, stage, f"{path}.{k}", memo)) for k, v in obj.items())
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, (list, tuple)):
        out = [to_host(v, stage, f"{path}.{i}", memo) for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    raise TypeError(
        f"{path} has type {type(obj).__qualname__}; a checkpoint holds tensors, int, float, str, "
        f"bool, None and dicts/lists/tuples of them (convert it, e.g. with its state_dict()).")


class HostStaging:
    """Host-memory copies of a state for asynchronous writes, reused from one save to the next.

    Copying into buffers that already exist avoids allocating (and page-faulting) a whole state's
    worth of fresh memory on every save, which is most of the time the caller is blocked. A buffer
    is reused only after the write that read it has finished (the store allows one in flight).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def snapshot(self, obj: Any) -> Any:
        """Returns a host copy of ``obj`` that later in-place updates of ``obj`` do not reach.

        Raises:
            TypeError: As :func:`to_host`.
        """
        used: dict[str, torch.Tensor] = {}

        def stage(path: str, tensor: torch.Tensor) -> torch.Tensor:
            buf = self._buffers.get(path)
            src = tensor.detach()
            if (buf is None or buf.shape != src.shape or buf.dtype != src.dtype
                    or not buf.is_contiguous()):
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            used[path] = buf.copy_(src)
            return buf

        out = to_host(obj, stage)
        self._buffers = used
        return out

    def clear(self) -> None:
        """Releases the buffers."""
        self._buffers = {}


class _HashingWriter:
    """A write-only stream for torch.save: hashes what it forwards while a worker thread writes
    it, and on local disks has a second worker push written data to disk as it goes."""

    def __init__(self, storage: Storage, raw: IO[bytes], pool: ThreadPoolExecutor) -> None:
        self._raw = raw
        self._pool = pool  # two workers: one writes, one syncs
        self._datasync = storage.writeback(raw)
        self._sync: Future[None] | None = None
        self._synced = 0  # bytes already handed to a datasync
        self._sha = hashlib.sha256()
        self.size = 0
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            for start in range(0, view.nbytes, _CHUNK):
                chunk = view[start:start + _CHUNK]
                if chunk.nbytes < _OVERLAP_MIN:
                    self._raw.write(chunk)
                    self._sha.update(chunk)
                    continue
                written = self._pool.submit(self._write_behind, chunk, self.size + start)
                self._sha.update(chunk)  # hashlib releases the GIL: runs while the write does
                written.result()
        except Exception as exc:  # recorded, then re-raised: torch turns it into RuntimeError
            self.error = exc
            raise
        self.size += view.nbytes
        return view.nbytes

    def _write_behind(self, chunk: memoryview, offset: int) -> None:
        self._raw.write(chunk)
        end = offset + chunk.nbytes
        idle = self._sync is None or self._sync.done()
        if self._datasync is not None and idle and end - self._synced >= _WRITEBACK:
            self._raw.flush()
            self._sync = self._pool.submit(self._datasync)
            self._synced = end

    def flush(self) -> None:
        """Nothing to do: the underlying file is flushed and synced when the payload is done."""

    def finish(self) -> FileEntry:
        """Waits for the background sync (raising its error) and returns size and checksum."""
        if self._sync is not None:
            self._sync.result()
        return FileEntry(size=self.size, sha256=self._sha.hexdigest())


@io_retry
def write_payload(storage: Storage, path: str, state: Any) -> FileEntry:
    """Streams ``state`` with torch.save to ``path``, durably on local disks.

    A transient error rewrites the whole file (the state is an immutable snapshot, so this is
    idempotent).

    Returns:
        The written file's size and sha256.

    Raises:
        OSError: (or the filesystem's own error) The storage failed during the write.
    """
    with storage.open_write(path) as raw, ThreadPoolExecutor(2, "checkpoint-io") as pool:
        writer = _HashingWriter(storage, raw, pool)
        try:
            torch.save(state, writer)
        except RuntimeError as exc:
            if writer.error is not None:
                raise writer.error from exc
            raise
        entry = writer.finish()
        storage.sync_file(raw)
    return entry


@io_retry
def _stream(storage: Storage, path: str, sink: IO[bytes] | None) -> tuple[int, str]:
    """Reads ``path`` once, in chunks, returning its size and sha256 and copying it to ``sink``
    (when given) on the way; the next chunk is read while this one is hashed. A retry starts
    over, ``sink`` emptied first."""
    if sink is not None:
        sink.seek(0)
        sink.truncate()
    sha, size = hashlib.sha256(), 0
    # Object stores: one ranged read per chunk, no read-ahead cache holding more.
    options = {} if storage.is_local else {"block_size": _CHUNK, "cache_type": "none"}
    with (storage.fs.open(path, "rb", **options) as f,
          ThreadPoolExecutor(1, "checkpoint-read") as pool):
        chunk = f.read(_CHUNK)
        while chunk:
            following = pool.submit(f.read, _CHUNK)
            sha.update(chunk)  # hashlib releases the GIL: runs while the next read does
            if sink is not None:
                sink.write(chunk)
            size += len(chunk)
            chunk = following.result()
    if sink is not None:
        sink.flush()
    return size, sha.hexdigest()


@contextlib.contextmanager
def _spool() -> Iterator[tuple[IO[bytes], str]]:
    """A file in memory (Linux: ``memfd_create``; elsewhere a temporary file) and a path that
    ``torch.load(mmap=True)`` maps: the loaded tensors then live in the spool's own pages, so
    a load from an object store holds the payload once, not a download plus its tensors."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("checkpoint-load", os.MFD_CLOEXEC)
        with open(fd, "w+b") as f:
            yield f, f"/proc/self/fd/{fd}"
        return
    with tempfile.NamedTemporaryFile("w+b", prefix="checkpoint-load-") as f:
        yield f, f.name


def _check(path: str, size: int, digest: str, expected: FileEntry) -> None:
    if (size, digest) != (expected.size, expected.sha256):
        raise CheckpointCorruptError(
            f"payload {path} does not match its manifest: {size} bytes, sha256 {digest} "
            f"(manifest: {expected.size} bytes, sha256 {expected.sha256}).")


def file_entry(storage: Storage, path: str) -> FileEntry:
    """Reads ``path`` back once, in chunks, and returns its size and sha256 (for files that
    others wrote).

    Raises:
        OSError: (or the filesystem's own error) the file is missing or unreadable.
    """
    return FileEntry(*_stream(storage, path, None))


def verify_payload(storage: Storage, path: str, expected: FileEntry) -> None:
    """Checks ``path``'s size and sha256 against its manifest entry, reading it once in chunks
    (never the whole file into memory).

    Raises:
        CheckpointCorruptError: Missing file, or wrong size or checksum.
    """
    try:
        size, digest = _stream(storage, path, None)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"payload {path} is missing.") from exc
    _check(path, size, digest, expected)


def read_payload(storage: Storage, path: str, expected: FileEntry) -> Any:
    """Verifies ``path`` against its manifest entry and decodes it without running code.

    One pass over the storage: local files are hashed in chunks and then memory-mapped; other
    filesystems are copied into a spool in memory while they are hashed, and the tensors are
    mapped from the spool. Either way a load holds the payload once plus a chunk or two.

    Raises:
        CheckpointCorruptError: Missing file, wrong size or checksum, or an undecodable archive.
        CheckpointUnsafeError: The archive asks for code or objects outside the weights-only set.
    """
    if storage.is_local:
        verify_payload(storage, path, expected)
        return _decode(path, path)
    with _spool() as (sink, spooled):
        try:
            size, digest = _stream(storage, path, sink)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"payload {path} is missing.") from exc
        _check(path, size, digest, expected)
        return _decode(path, spooled)


def _decode(path: str, source: str) -> Any:
    """``torch.load`` of the verified payload at ``source`` (memory-mapped, weights only)."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointUnsafeError(
            f"payload {path} was refused: it holds objects that weights-only loading does not "
            f"allow (code or arbitrary classes); nothing from it was run. {exc}") from exc
    except (RuntimeError, EOFError, ValueError, KeyError) as exc:
        raise CheckpointCorruptError(f"payload {path} cannot be decoded: {exc}") from exc
