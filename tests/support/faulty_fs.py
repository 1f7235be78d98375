"""A fault-injecting fsspec filesystem, registered as ``faultmem://``, and its fixture.

Writes of one named file fail after a number of bytes, rot (one byte flipped), or stall until the
test releases them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

PAYLOAD_NAME = "state.pt"


@dataclass
class FaultPlan:
    """What the ``faultmem://`` filesystem does to writes of files named ``target``.

    Attributes:
        fail_after_bytes: Raise once this many bytes of the target were written (None: never).
        failures: How many writes fail before the filesystem heals.
        error: Builds the exception to raise.
        corrupt: Flip one byte of the next target write as it is stored (bit rot that keeps
            the size: only a checksum can tell).
        gate: If set, every target write blocks until this Event is set.
        started: Set when a target write begins.
        fired: How many failures were injected.
    """

    target: str = PAYLOAD_NAME
    fail_after_bytes: int | None = None
    failures: int = 1
    error: Callable[[], Exception] = lambda: OSError(28, "injected: no space left on device")
    corrupt: bool = False
    gate: threading.Event | None = None
    started: threading.Event = field(default_factory=threading.Event)
    fired: int = 0


class _FaultyFile(MemoryFile):
    def __init__(self, fs: FaultyMemoryFileSystem, path: str) -> None:
        super().__init__(fs, path)
        self._written = 0
        self._plan = fs.plan if path.rsplit("/", 1)[-1] == fs.plan.target else None

    def write(self, data: Any) -> int:
        plan = self._plan
        if plan is not None:
            plan.started.set()
            if plan.gate is not None:
                assert plan.gate.wait(30), "test never released the gated write"
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

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode not in {"wb", "w+b"}:
            return super()._open(path, mode, **kwargs)
        path = self._strip_protocol(path)
        f = _FaultyFile(self, path)
        f.commit()
        return f


fsspec.register_implementation("faultmem", FaultyMemoryFileSystem, clobber=True)


@pytest.fixture
def faulty_fs() -> Iterator[type[FaultyMemoryFileSystem]]:
    """The fault-injecting filesystem class, with an empty store and a fresh plan."""
    FaultyMemoryFileSystem.store.clear()
    FaultyMemoryFileSystem.pseudo_dirs[:] = [""]
    FaultyMemoryFileSystem.plan = FaultPlan()
    yield FaultyMemoryFileSystem
    if FaultyMemoryFileSystem.plan.gate is not None:
        FaultyMemoryFileSystem.plan.gate.set()  # never leave a writer thread blocked
    FaultyMemoryFileSystem.store.clear()
