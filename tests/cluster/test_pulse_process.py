"""The heartbeat process over real sockets: it beats while its worker (this test's process)
runs, takes connections back, reads a stopped process as stopped, and ends with its worker's
end of the control socket."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from elastic.cluster.links.heartbeat import BEAT
from elastic.cluster.links.pulse_child import is_stopped
from elastic.cluster.links.pulse_process import PulseProcess
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(60)

INTERVAL_S = 0.05


def _pending(sock: socket.socket) -> bytes:
    try:
        return sock.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


def test_the_pulse_beats_on_held_connections_until_they_are_dropped():
    pulse = PulseProcess(INTERVAL_S)
    ours, theirs = socket.socketpair()
    try:
        assert pulse.start() and pulse.hold("round-1", [ours])
        assert poll_until(lambda: len(_pending(theirs)) >= 3 * len(BEAT), 10)
        assert set(_pending(theirs).split(BEAT)) == {b""}  # nothing but whole heartbeats
        pulse.drop("round-1")
        ours.close()  # the pulse's copy closed too: the peer sees the end
        assert poll_until(lambda: theirs.recv(4096) == b"", 10)
    finally:
        pulse.close()
        theirs.close()


def test_the_pulse_ends_when_its_worker_lets_go_of_the_control_socket():
    pulse = PulseProcess(INTERVAL_S)
    assert pulse.start()
    pid = pulse.pid
    pulse.close()  # closes the control socket, as the kernel does when the worker ends
    assert pid is not None and pulse.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: gone


def test_a_stopped_process_reads_as_stopped_and_a_running_one_not():
    # A child that lives until the test kills it: it blocks reading a pipe nobody writes.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        assert poll_until(lambda: is_stopped(child.pid) is False, 10)
        child.send_signal(signal.SIGSTOP)
        assert poll_until(lambda: is_stopped(child.pid), 10)
        child.send_signal(signal.SIGCONT)
        assert poll_until(lambda: is_stopped(child.pid) is False, 10)
    finally:
        child.kill()
        child.wait()
        child.stdin.close()  # type: ignore[union-attr]
    assert is_stopped(child.pid) is None


def test_the_pulse_runs_above_the_workers_priority_where_allowed():
    pulse = PulseProcess(INTERVAL_S)
    try:
        assert pulse.start()
        pid = pulse.pid
        assert pid is not None
        # root here: the lowest real-time priority (elsewhere it may stay at the worker's)
        assert poll_until(lambda: os.sched_getscheduler(pid) == os.SCHED_RR, 10)
    finally:
        pulse.close()
