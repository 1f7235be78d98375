"""Fault-injecting fsspec filesystems, ``faultmem://`` (in memory) and ``faultfile://`` (local
files), and the fixture of the first.

Writes of the files a name pattern matches fail after a number of bytes, rot (one byte flipped), or stall until the
test releases them; the first reads (listings and file reads) fail a number of times before the
filesystem heals. ``faultfile://`` serves worker processes: its plan comes from the environment
variable ``FAULTFS_PLAN`` (JSON, see ``plan_from_env``), read when the worker imports this module.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

#: The payload files of replicated checkpoints (``state.<writer>.pt``; ``state.pt`` before).
PAYLOAD_FILES = "state*.pt"
PLAN_VARIABLE = "FAULTFS_PLAN"


def busy() -> Exception:
    """What s3fs raises for an S3 503 (Service Unavailable, SlowDown): ``OSError(EBUSY)``."""
    return OSError(errno.EBUSY, "injected: 503 Service Unavailable")


#: The read errors a ``FAULTFS_PLAN`` names.
READ_ERRORS: dict[str, Callable[[], Exception]] = {
    "busy": busy,
    "io": lambda: OSError(errno.EIO, "injected: input/output error"),
    "reset": lambda: ConnectionResetError(errno.ECONNRESET, "injected: connection reset"),
}


@dataclass
class FaultPlan:
    """What the ``faultmem://`` filesystem does to writes of files whose name matches ``target``
    (a glob).

    Attributes:
        fail_after_bytes: Raise once this many bytes of the target were written (None: never).
        failures: How many writes fail before the filesystem heals.
        error: Builds the exception to raise.
        corrupt: Flip one byte of the next target write as it is stored (bit rot that keeps
            the size: only a checksum can tell).
        gate: If set, every target write blocks until this Event is set.
        started: Set when a target write begins.
        fired: How many failures were injected.
        read_failures: How many reads (a listing, opening a file to read) fail before the
            filesystem heals.
        read_error: Builds the exception a failing read raises.
        read_target: Only reads of files whose name matches this glob fail (None: every read,
            listings too).
        read_gate: If set, reads (of ``read_target``) block until this Event is set (a hung
            mount).
        fail_while: Reads fail only while a file exists at this path (the switch that crosses
            processes); None: from the first read.
        reads_failed: How many reads failed.
        gate_fifo: ``faultfile://`` only: target writes block opening this named pipe until
            the test opens it for writing (the release that crosses processes).
        started_marker: ``faultfile://`` only: a file created when a target write begins.
    """

    target: str = PAYLOAD_FILES
    fail_after_bytes: int | None = None
    failures: int = 1
    error: Callable[[], Exception] = lambda: OSError(28, "injected: no space left on device")
    corrupt: bool = False
    gate: threading.Event | None = None
    started: threading.Event = field(default_factory=threading.Event)
    fired: int = 0
    read_failures: int = 0
    read_error: Callable[[], Exception] = busy
    reads_failed: int = 0
    read_target: str | None = None
    fail_while: str | None = None
    read_gate: threading.Event | None = None
    gate_fifo: str | None = None
    started_marker: str | None = None

    def read(self, path: str) -> None:
        """Fails this read of ``path`` if reads (of it) are still to fail."""
        if self.read_target is not None and not matches(path, self.read_target):
            return
        if self.read_gate is not None:
            assert self.read_gate.wait(30), "test never released the gated read"
        if self.fail_while is not None and not os.path.exists(self.fail_while):
            return
        if self.reads_failed < self.read_failures:
            self.reads_failed += 1
            raise self.read_error()

    def hold_write(self) -> None:
        """Blocks a target write on the cross-process gate, if there is one."""
        if self.started_marker is not None:
            with open(self.started_marker, "a", encoding="utf-8") as marker:
                marker.write(f"{os.getpid()}\n")
        if self.gate_fifo is not None:
            with open(self.gate_fifo, "rb"):  # returns once the test opens it for writing
                pass


def matches(path: str, pattern: str) -> bool:
    """Whether the file name of ``path`` matches the glob ``pattern``."""
    return fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)


def plan_from_env() -> FaultPlan:
    """The plan named by ``FAULTFS_PLAN``: JSON with ``read_failures`` (int), ``read_error``
    (a key of ``READ_ERRORS``), ``read_target`` and ``target`` (file names), ``fail_while``,
    ``gate_fifo`` and ``started_marker`` (paths); an empty plan when the variable is unset."""
    spec = json.loads(os.environ.get(PLAN_VARIABLE) or "{}")
    return FaultPlan(target=spec.get("target", PAYLOAD_FILES),
                     read_failures=int(spec.get("read_failures", 0)),
                     read_error=READ_ERRORS[spec.get("read_error", "busy")],
                     read_target=spec.get("read_target"), fail_while=spec.get("fail_while"),
                     gate_fifo=spec.get("gate_fifo"), started_marker=spec.get("started_marker"))


class _FaultyFile(MemoryFile):
    def __init__(self, fs: FaultyMemoryFileSystem, path: str) -> None:
        super().__init__(fs, path)
        self._written = 0
        self._plan = fs.plan if matches(path, fs.plan.target) else None

    def write(self, data: Any) -> int:
        plan = self._plan
        if plan is not None:
            gate = plan.gate  # read before ``started``: the test may drop the gate once it is set
            plan.started.set()
            if gate is not None:
                assert gate.wait(30), "test never released the gated write"
            n = memoryview(data).nbytes
            limit = plan.fail_after_bytes
            if limit is not None and plan.fired < plan.failures and self._written + n > limit:
                plan.fired += 1
                super().write(memoryview(data)[: max(0, limit - self._written)])
                raise plan.error()
            self._written += n
            if plan.corrupt and n:
                plan.corrupt = False
                plan.fired += 1
                rotten = bytearray(memoryview(data).cast("B"))
                rotten[n // 2] ^= 0xFF
                return super().write(bytes(rotten))
        return super().write(data)


class FaultyMemoryFileSystem(MemoryFileSystem):
    """An in-memory filesystem (its own store) whose writes fail or stall on request."""

    protocol = "faultmem"
    store: dict[str, Any] = {}
    pseudo_dirs = [""]
    plan = FaultPlan()

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.plan.read(path)
        return super().find(path, *args, **kwargs)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.plan.read(path)
        return super().cat_file(path, *args, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode not in {"wb", "w+b"}:
            self.plan.read(path)
            return super()._open(path, mode, **kwargs)
        path = self._strip_protocol(path)
        f = _FaultyFile(self, path)
        f.commit()
        return f


class FaultyLocalFileSystem(LocalFileSystem):
    """Local files under ``faultfile://``, whose reads fail and writes stall as ``plan`` says
    (in a worker process: as ``FAULTFS_PLAN`` says)."""

    protocol = "faultfile"
    root_marker = "/"
    plan = plan_from_env()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith("faultfile://"):
            path = path[len("faultfile://"):]
        return LocalFileSystem._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return f"faultfile://{self._strip_protocol(name)}"

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.plan.read(path)
        return super().find(path, *args, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            self.plan.read(path)
        elif matches(path, self.plan.target):
            self.plan.hold_write()
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("faultmem", FaultyMemoryFileSystem, clobber=True)
fsspec.register_implementation("faultfile", FaultyLocalFileSystem, clobber=True)


@pytest.fixture
def faulty_fs() -> Iterator[type[FaultyMemoryFileSystem]]:
    """The fault-injecting filesystem class, with an empty store and a fresh plan."""
    FaultyMemoryFileSystem.store.clear()
    FaultyMemoryFileSystem.pseudo_dirs[:] = [""]
    FaultyMemoryFileSystem.plan = FaultPlan()
    yield FaultyMemoryFileSystem
    for gate in (FaultyMemoryFileSystem.plan.gate, FaultyMemoryFileSystem.plan.read_gate):
        if gate is not None:
            gate.set()  # never leave a thread blocked
    FaultyMemoryFileSystem.store.clear()
