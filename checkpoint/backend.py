"""The fsspec boundary: resolving a URL to a filesystem, and every I/O call made through it.

This module owns scheme resolution (with an error naming the package to install), retries of
transient storage errors (tenacity, bounded), and durability on local disks (fsync of files and
directories). It knows nothing about manifests, tensors or retention, and never imports the rest
of the project.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, Any, Concatenate, ParamSpec, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations
from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from elastic.checkpoint.errors import (CheckpointBackendError, CheckpointCredentialsError,
                                       CheckpointError, CheckpointStorageError)

logger = logging.getLogger(__name__)


def _object_store_connection_errors() -> tuple[type[BaseException], ...]:
    """The object-store clients' own connection errors that are importable here (by type, never
    by message): botocore's (s3fs), which derive from neither ``ConnectionError`` nor
    ``OSError``."""
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError  # noqa: PLC0415
        from botocore.exceptions import ReadTimeoutError  # noqa: PLC0415
    except ImportError:
        return ()  # no boto: no s3fs either
    return (BotoConnectionError, ReadTimeoutError)


#: Errors worth another try: a dropped connection or a timeout. Everything else (missing file,
#: permission denied, a full disk) is reported at once.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError,
                                                     *_object_store_connection_errors())
#: ``OSError`` numbers worth another try: "busy" is what s3fs makes of an S3 503 (Service
#: Unavailable, SlowDown), "try again" what a loaded NFS server or FUSE mount answers.
TRANSIENT_ERRNOS = frozenset({errno.EBUSY, errno.EAGAIN})


#: What ``link(2)`` answers on filesystems without hard links (some FUSE and SMB mounts).
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS,
                            errno.EMLINK})


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth another try (by type, and for ``OSError`` by its number)."""
    return isinstance(exc, TRANSIENT_ERRORS) or (
        isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS)

#: How long one storage call retries transient errors before its error is raised when the
#: caller does not say: only for a ``CheckpointStore`` used outside a job (its public signature
#: is fixed by DESIGN.md). Inside a job every caller passes its timeout table's
#: ``storage_retry``; a test keeps this equal to that field's default. This layer may not
#: import the table, so this is the one duration it names.
DEFAULT_RETRY_FOR = timedelta(seconds=60)
_ATTEMPTS = 5  # at most, within the deadline
_FIRST_PAUSE_S, _LONGEST_PAUSE_S, _JITTER_S = 1.0, 5.0, 0.5  # 1 s, 2 s, 4 s (+ up to 0.5 s)

P = ParamSpec("P")
T = TypeVar("T")


def credentials_errors() -> tuple[type[BaseException], ...]:
    """The object-store clients' "no credentials" errors that are importable here (by type,
    never by message): botocore's (s3fs) and google-auth's (gcsfs)."""
    found: list[type[BaseException]] = []
    try:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError  # noqa: PLC0415
        found += [NoCredentialsError, PartialCredentialsError]
    except ImportError:
        pass  # no boto: no s3fs either
    try:
        from google.auth.exceptions import DefaultCredentialsError  # noqa: PLC0415
        found.append(DefaultCredentialsError)
    except ImportError:
        pass  # no google-auth: no gcsfs either
    return tuple(found)


def io_retry(call: Callable[Concatenate[Storage, P], T]) -> Callable[Concatenate[Storage, P], T]:
    """Retries ``call`` on transient errors, up to its storage's ``retry_for`` (the first
    argument of ``call`` is the ``Storage``: ``self`` of its methods, or a function's own)."""
    @functools.wraps(call)
    def retried(storage: Storage, *args: P.args, **kwargs: P.kwargs) -> T:
        retrying = Retrying(
            stop=stop_after_delay(storage.retry_for.total_seconds())
            | stop_after_attempt(_ATTEMPTS),
            retry=retry_if_exception(is_transient),
            wait=wait_exponential_jitter(multiplier=_FIRST_PAUSE_S, max=_LONGEST_PAUSE_S,
                                         jitter=_JITTER_S),
            before_sleep=before_sleep_log(logger, logging.WARNING),
            reraise=True,
        )
        try:
            return retrying(call, storage, *args, **kwargs)
        except credentials_errors() as exc:
            raise CheckpointCredentialsError(
                f"No credentials for checkpoint storage {storage.url_of(storage.root)!r} "
                f"({type(exc).__name__}: {exc}). Give them to every worker, e.g. "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE for s3://, "
                "GOOGLE_APPLICATION_CREDENTIALS for gs://.") from exc
        except (OSError, CheckpointError):
            raise  # ours, or the file errors callers tell apart (a missing file, a full disk)
        except Exception as exc:  # an object store's own error type: typed here, at the edge
            raise CheckpointStorageError(
                f"{call.__name__} on {storage.url_of(storage.root)!r} failed: "
                f"{type(exc).__name__}: {exc}. Check that the storage is reachable from this "
                "machine and that its settings (endpoint, bucket, region) are right.") from exc
    return retried


def _install_hint(protocol: str) -> str:
    """Returns what to install for ``protocol``, from fsspec's table of known implementations."""
    known = known_implementations.get(protocol, {})
    return known.get("err") or f"Install the package that provides the {protocol!r} fsspec scheme."


def resolve_filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """Resolves ``url`` to an fsspec filesystem and the root path inside it.

    Args:
        url: A local path or any fsspec URL (``file://``, ``memory://``, ``s3://`` ...).
        storage_options: Keyword arguments for the filesystem (credentials, endpoint_url ...).

    Returns:
        The filesystem instance and the root path without its protocol, no trailing slash.

    Raises:
        CheckpointBackendError: The scheme is unknown, or its package is not installed.
    """
    protocol, _ = fsspec.core.split_protocol(url)
    protocol = protocol or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        raise CheckpointBackendError(
            f"Checkpoint URL {url!r} needs the fsspec backend for {protocol!r}, which is not "
            f"installed: {_install_hint(protocol)} (pip install it into this environment)."
        ) from exc
    except ValueError as exc:
        raise CheckpointBackendError(
            f"Checkpoint URL {url!r} has scheme {protocol!r}, which no installed fsspec "
            f"implementation provides. Use a local path, file://, memory://, s3:// (pip install "
            f"s3fs), gs:// (pip install gcsfs), az:// (pip install adlfs), or pip install the "
            f"package that registers {protocol!r} with fsspec."
        ) from exc
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, root.rstrip("/") or "/"


@dataclass(frozen=True)
class Storage:
    """A checkpoint root on one fsspec filesystem, with retried, durable I/O helpers.

    Attributes:
        fs: The fsspec filesystem.
        root: The root path inside ``fs`` (no protocol, no trailing slash).
        retry_for: How long one call retries transient errors before raising.
    """

    fs: Any
    root: str
    retry_for: timedelta = DEFAULT_RETRY_FOR

    def __post_init__(self) -> None:
        if self.retry_for <= timedelta(0):
            raise ValueError(f"retry_for ({self.retry_for}) must be positive.")

    @property
    def is_local(self) -> bool:
        """Whether the files live on a local disk (fsync and mmap apply)."""
        return isinstance(self.fs, LocalFileSystem)

    def join(self, *parts: str) -> str:
        """Returns the path of ``parts`` under the root."""
        return "/".join([self.root.rstrip("/"), *parts])

    def url_of(self, path: str) -> str:
        """Returns ``path`` as a full URL with its protocol."""
        return self.fs.unstrip_protocol(path)

    @io_retry
    def entries(self) -> dict[str, dict[str, Any]]:
        """Lists files and directories up to two levels below the root.

        Returns:
            A map from the path relative to the root to fsspec's info (``type``, ``size``).
        """
        # The whole cache: object-store listings of the step directories (cached while a writer
        # was still writing them) would otherwise hide manifests written since.
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self.root, maxdepth=2, withdirs=True, detail=True)
        except FileNotFoundError:
            return {}
        prefix = self.root.rstrip("/") + "/"
        return {p[len(prefix):]: info for p, info in found.items() if p.startswith(prefix)}

    @io_retry
    def read_bytes(self, path: str) -> bytes:
        """Reads a whole file."""
        return self.fs.cat_file(path)

    @io_retry
    def write_bytes(self, path: str, data: bytes) -> None:
        """Writes a whole (small) file, durably on local disks."""
        with self.open_write(path) as f:
            f.write(data)
            self.sync_file(f)

    @io_retry
    def create_bytes(self, path: str, data: bytes) -> None:
        """Writes a whole (small) file only if none exists at ``path``, in one atomic step.

        Local disks write a temporary file and hard-link it into place (where links are not
        supported: an exclusive create, not atomic for readers); elsewhere an existing file is
        looked for first, then ``fs.pipe_file(mode="create")`` writes: a conditional write on
        object stores (``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS), which
        closes the window between the look and the write where the server honours it (see
        docs/storage.md). A retry after a transient error that finds ``data`` itself already
        there counts as done: the first try landed.

        Raises:
            FileExistsError: another writer created ``path`` first.
        """
        try:
            if self.is_local:
                self._link_into_place(path, data)
            else:
                self.fs.invalidate_cache(path)  # a listing cached before the other's write
                if self.fs.exists(path):  # servers that ignore the condition still refuse
                    raise FileExistsError(errno.EEXIST, "exists already", path)
                self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            if self._holds(path, data):
                return
            raise

    def _link_into_place(self, path: str, data: bytes) -> None:
        parent, name = path.rsplit("/", 1)
        self.fs.makedirs(parent, exist_ok=True)
        spare = f"{parent}/.{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        with open(spare, "wb") as f:
            f.write(data)
            self.sync_file(f)
        try:
            os.link(spare, path)  # fails with FileExistsError where one is already
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            with open(path, "xb") as f:  # O_EXCL still: only not atomic for readers
                f.write(data)
                self.sync_file(f)
        finally:
            os.unlink(spare)

    def _holds(self, path: str, data: bytes) -> bool:
        """Whether ``path`` holds exactly ``data`` (a retried create whose first try landed)."""
        try:
            return self.fs.cat_file(path) == data
        except FileNotFoundError:
            return False

    @io_retry
    def remove(self, path: str, recursive: bool = False) -> None:
        """Removes a file or a directory tree; a missing path is not an error."""
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass

    def discard(self, path: str) -> None:
        """Removes what an unfinished write left at ``path`` (a file or a directory tree); when
        that fails, warns: readers ignore it, and a later save removes it."""
        try:
            self.remove(path, recursive=True)
        except OSError as exc:
            logger.warning("could not remove %s of an unfinished checkpoint (%r); it is ignored "
                           "by readers and removed by a later save", self.url_of(path), exc)

    def remove_empty_dir(self, path: str) -> None:
        """Removes the local directory ``path`` if it is empty (object stores have none); one
        that stays (not empty, or not removable) is left to retention's clean-up of torn
        directories."""
        if self.is_local:
            with contextlib.suppress(OSError):
                os.rmdir(path)

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        """Opens ``path`` for writing, creating its parent directory first."""
        parent = path.rsplit("/", 1)[0]
        if self.is_local:
            self.fs.makedirs(parent, exist_ok=True)
        with self.fs.open(path, "wb") as f:
            yield f

    def sync_file(self, f: IO[bytes]) -> None:
        """Forces a local file's data to disk; object stores commit on close instead."""
        if self.is_local:
            f.flush()
            os.fsync(f.fileno())

    def writeback(self, f: IO[bytes]) -> Callable[[], None] | None:
        """Returns a call that forces what was written to a local file so far onto the disk.

        Meant to run on another thread while writing goes on: without it the kernel holds the
        whole checkpoint in dirty pages until the final fsync, so serialising and the disk write
        happen one after the other instead of overlapping. ``None`` for object stores (their
        ``close`` commits).
        """
        if not self.is_local:
            return None
        fd = f.fileno()
        return lambda: os.fdatasync(fd)

    def sync_dir(self, path: str) -> None:
        """Forces a local directory's entries (new files) to disk; no-op elsewhere."""
        if not self.is_local:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
