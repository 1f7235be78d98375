"""A forked child lets go of the sockets registered with the fork guard, and of nothing else."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from elastic.cluster.links.fork_guard import ForkGuard

pytestmark = pytest.mark.timeout(30)


@contextlib.contextmanager
def forked_child() -> Iterator[None]:
    """A child forked now that lives until the block ends (like a DataLoader worker outliving
    its parent); it holds whatever the fork left it."""
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os-level calls, then _exit
        try:
            os.write(ready_w, b"ok")
            os.read(release_r, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 2) == b"ok"
        yield
    finally:
        os.write(release_w, b"x")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, release_r, release_w):
            os.close(fd)


def test_a_forked_child_does_not_keep_a_registered_connection_open():
    guard = ForkGuard()
    ours, peer = socket.socketpair()
    guard.hold([ours.fileno()])
    with forked_child(), peer:
        ours.close()  # the worker dies; its child lives on
        peer.settimeout(5)
        assert peer.recv(1) == b"", "the peer saw no end while the forked child was alive"


def test_an_unregistered_connection_stays_open_in_the_child_and_the_parent_keeps_its_own():
    guard = ForkGuard()
    registered, registered_peer = socket.socketpair()
    other, other_peer = socket.socketpair()
    guard.hold([registered.fileno()])
    with forked_child(), registered, registered_peer, other_peer:
        registered.sendall(b"a")  # the parent's registered socket still works after the fork
        assert registered_peer.recv(1) == b"a"
        other.close()  # not registered: the child's copy keeps the connection open
        other_peer.settimeout(0.2)
        with pytest.raises(socket.timeout):
            other_peer.recv(1)


def test_a_released_descriptor_is_no_longer_let_go_of():
    guard = ForkGuard()
    a, b = socket.socketpair()
    guard.hold([a.fileno(), b.fileno()])
    guard.release([a.fileno()])
    assert guard.held == [b.fileno()]
    a.close()
    b.close()


def test_a_registered_descriptor_is_not_inherited_by_a_program_the_worker_runs():
    guard = ForkGuard()
    registered, peer = socket.socketpair()
    with registered, peer:
        os.set_inheritable(registered.fileno(), True)  # as gloo leaves its sockets
        guard.hold([registered.fileno()])
        fd = registered.fileno()
        probe = f"import os; print(os.path.exists('/proc/self/fd/{fd}'))"
        child = subprocess.run([sys.executable, "-c", probe], close_fds=False,
                               capture_output=True, text=True, timeout=20, check=True)
        assert child.stdout.strip() == "False", "the child's program inherited the socket"
