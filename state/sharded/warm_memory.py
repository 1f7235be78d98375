"""Host memory touched ahead of a reshard, so that the reshard's allocations find pages that
are mapped already instead of faulting each 4 KiB in while the running ranks wait.

``WarmMemory.touch`` allocates heap memory in pieces below glibc's mmap threshold, writes them
and frees all but the last: glibc merges the freed pieces into one free block that stays mapped
(it returns only free memory at the heap's top, and the kept piece sits above the block) and
serves later allocations of any size, torch's tensors among them, from that block before it
maps new memory. ``release`` frees the kept piece.

Only glibc's allocator is known to behave so; elsewhere ``touch`` does nothing. It takes at most
half of the memory the machine, or the process's memory cgroup, has free. Must not know where
the figure to touch comes from.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

PIECE = 64 << 10  # below glibc's smallest mmap threshold (128 KiB): the pieces are heap memory
_CLOCK_EVERY = 256  # pieces between two looks at the deadline
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
# (limit, usage) files of a memory cgroup: v2, then v1
_CGROUP_FILES = (("memory.max", "memory.current"),
                 ("memory.limit_in_bytes", "memory.usage_in_bytes"))


def available_bytes() -> int:
    """The memory free now: the machine's, or less if a memory cgroup of this process has
    less room left (0 where the machine's cannot be told)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0
    return min([free] + [room for room in map(_cgroup_room, _cgroup_dirs()) if room is not None])


def _cgroup_dirs() -> list[Path]:
    """This process's memory cgroup directories as mounted (v2 and v1), and their roots (a
    container's own cgroup under a cgroup namespace)."""
    root = Path("/sys/fs/cgroup")
    found = [root, root / "memory"]
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found.append(root / path.lstrip("/"))
        elif "memory" in controllers.split(","):
            found.append(root / "memory" / path.lstrip("/"))
    return found


def _cgroup_room(directory: Path) -> int | None:
    """What the cgroup at ``directory`` may still take; None without one or without a limit."""
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            limit = (directory / limit_file).read_text().strip()
            usage = int((directory / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= _NO_LIMIT:
            return None
        return max(0, int(limit) - usage)
    return None


@functools.cache
def _glibc() -> ctypes.PyDLL | None:
    """The process's C library when it is glibc, its calls holding the GIL (a thread that
    imports meanwhile would otherwise take it back after every piece)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError):
        return None
    libc = ctypes.PyDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.memset.restype = ctypes.c_void_p
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.free.restype = None
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


class WarmMemory:
    """Touched heap memory kept mapped for the next allocations: ``touch``, then ``release``."""

    def __init__(self) -> None:
        self._kept: int | None = None  # the last piece, which keeps the block below it mapped

    def touch(self, nbytes: int, deadline: float) -> int:
        """Writes ``nbytes`` (rounded up to whole pieces, capped at half the free memory) of
        heap memory and leaves it mapped and free; stops at ``deadline`` (``time.monotonic``).
        Returns the bytes touched: 0 without glibc, when nothing was asked, or when touched
        already and not released since."""
        libc = _glibc()
        if libc is None or self._kept is not None or nbytes <= 0:
            return 0
        pieces = min(-(-nbytes // PIECE), available_bytes() // 2 // PIECE)
        taken: list[int] = []
        try:
            for i in range(pieces):
                if i % _CLOCK_EVERY == 0 and time.monotonic() >= deadline:
                    break
                address = libc.malloc(PIECE)
                if not address:
                    break  # out of memory: what was touched still helps
                libc.memset(address, 0, PIECE)
                taken.append(address)
        finally:
            if taken:
                self._kept = taken.pop()
            for address in taken:
                libc.free(address)
        touched = (len(taken) + (self._kept is not None)) * PIECE
        log.debug("touched %d bytes of heap memory ahead of the reshard", touched)
        return touched

    def release(self) -> None:
        """Frees the kept piece: the free block is an ordinary part of the heap again."""
        kept, self._kept = self._kept, None
        if kept is not None:
            libc = _glibc()
            assert libc is not None  # only glibc's touch keeps a piece
            libc.free(kept)
