"""Heap memory touched ahead of a reshard: the allocations after it fault almost no pages in,
it is touched once until released, it stops at its deadline and takes at most half of the free
memory."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from elastic.foundation.timeouts import Timeouts
from elastic.state.sharded import warm_memory
from elastic.state.sharded.warm_memory import PIECE, WarmMemory

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(warm_memory._glibc() is None, reason="needs glibc's malloc")]

SIZE = 48 << 20  # above glibc's largest mmap threshold (32 MiB): mapped afresh when cold
PAGES = SIZE // 4096
# In a fresh process (no heap left by other tests) and without torch (fast): a block taken as
# torch's CPU allocator takes it (posix_memalign, 64-byte aligned) and written, cold, then
# after a touch of twice its size; prints the page faults of each.
PROBE = f"""
import ctypes, importlib.util, resource, sys, time
spec = importlib.util.spec_from_file_location("warm_memory", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
libc = ctypes.CDLL(None)

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = ctypes.c_void_p()
    assert libc.posix_memalign(ctypes.byref(block), 64, ctypes.c_size_t({SIZE})) == 0
    ctypes.memset(block, 1, {SIZE})
    taken = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(block)
    return taken

cold = faults()
module.WarmMemory().touch({2 * SIZE}, time.monotonic() + 60)
print(cold, faults())
"""


def test_a_block_allocated_after_a_touch_faults_almost_none_of_its_pages_in():
    done = subprocess.run([sys.executable, "-c", PROBE, warm_memory.__file__],
                          capture_output=True, text=True,
                          timeout=Timeouts().local_start.total_seconds())
    assert done.returncode == 0, done.stderr[-2000:]
    cold, warm = map(int, done.stdout.split())
    if cold < PAGES / 2:
        pytest.skip(f"fresh memory faulted {cold} times for {PAGES} pages: huge pages")
    assert warm < PAGES / 20, (cold, warm)


def test_a_touch_rounds_up_to_whole_pieces_and_happens_once_until_released():
    warm = WarmMemory()
    try:
        assert warm.touch(PIECE + 1, time.monotonic() + 60) == 2 * PIECE
        assert warm.touch(PIECE, time.monotonic() + 60) == 0  # touched already
        warm.release()
        assert warm.touch(PIECE, time.monotonic() + 60) == PIECE
    finally:
        warm.release()


def test_a_touch_past_its_deadline_or_of_nothing_touches_nothing():
    warm = WarmMemory()
    assert warm.touch(SIZE, time.monotonic() - 1) == 0
    assert warm.touch(0, time.monotonic() + 60) == 0
    warm.release()  # nothing kept: nothing to free


def test_a_touch_takes_at_most_half_of_the_free_memory(monkeypatch):
    monkeypatch.setattr(warm_memory, "available_bytes", lambda: 8 * PIECE + 1)
    warm = WarmMemory()
    try:
        assert warm.touch(100 * PIECE, time.monotonic() + 60) == 4 * PIECE
    finally:
        warm.release()


def test_a_memory_cgroup_with_less_room_than_the_machine_caps_the_free_memory(
        monkeypatch, tmp_path):
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "memory.max").write_text(f"{300 << 20}\n")
    (tmp_path / "v2" / "memory.current").write_text(f"{100 << 20}\n")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "v1" / "memory.usage_in_bytes").write_text("1000\n")
    monkeypatch.setattr(warm_memory, "_cgroup_dirs",
                        lambda: [tmp_path / "v1", tmp_path / "v2", tmp_path / "none"])
    assert warm_memory.available_bytes() == 200 << 20
    monkeypatch.setattr(warm_memory, "_cgroup_dirs", lambda: [tmp_path / "v1"])
    assert warm_memory.available_bytes() > 200 << 20  # no limit: the machine's free memory
