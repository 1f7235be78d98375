"""Signal handlers that take no lock: a signal that lands while the main thread holds the very
lock the handling needs is still handled, and restoring leaves nothing behind."""

from __future__ import annotations

import logging
import os
import select
import signal
import threading

import pytest
import torch

from elastic import ElasticState

from elastic.launch.stop_signal import StopSignal
from elastic.foundation.signals import relay_signals
from tests.support.cli import WORKERS

pytestmark = pytest.mark.timeout(20)  # a handler that deadlocks fails here instead of hanging


def test_a_signal_that_lands_while_the_main_thread_is_inside_the_wake_event_is_handled():
    wake = threading.Event()
    stop = StopSignal(wake)
    restore = stop.install()
    try:
        # The main thread holds the Event's condition lock, as it does for a moment inside
        # wake.wait() or wake.clear(); a handler that set the Event itself would wait for it
        # forever (the lock is not reentrant).
        with wake._cond:  # noqa: SLF001 (the exact lock the old handler deadlocked on)
            signal.raise_signal(signal.SIGTERM)
        assert stop.requested.wait(5) and wake.wait(5)
        assert not stop.forced.is_set()
        with wake._cond:  # noqa: SLF001
            signal.raise_signal(signal.SIGINT)
        assert stop.forced.wait(5), "the second signal asks for the immediate kill"
    finally:
        restore()


def test_restoring_puts_back_the_previous_handlers_and_ends_the_relay_thread():
    before = signal.getsignal(signal.SIGTERM)
    seen: list[signal.Signals] = []
    restore = relay_signals((signal.SIGTERM,), seen.append, "relay-under-test")
    relays = [t for t in threading.enumerate() if t.name == "relay-under-test"]
    assert len(relays) == 1 and signal.getsignal(signal.SIGTERM) is not before
    signal.raise_signal(signal.SIGTERM)
    restore()
    assert seen == [signal.SIGTERM], "a signal relayed before restore() is delivered"
    assert signal.getsignal(signal.SIGTERM) is before
    assert not relays[0].is_alive()


def test_off_the_main_thread_nothing_is_installed():
    results: list[object] = []

    def install() -> None:
        restore = relay_signals((signal.SIGTERM,), lambda sig: None, "never")
        results.append(signal.getsignal(signal.SIGTERM))
        restore()

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=install)
    thread.start()
    thread.join(5)
    assert results == [before]


def test_a_sigterm_asks_to_leave_as_soon_as_it_is_handled_even_while_the_relay_thread_lags():
    """The run loop reads the leave request on the main thread right after registering; a
    request that only the relay thread records can come too late, and the worker trains."""
    release = threading.Event()

    class Lagging(logging.Handler):  # holds the relay thread inside its callback's log line
        def emit(self, record: logging.LogRecord) -> None:
            release.wait(10)

    logger = logging.getLogger("elastic.elastic_state")
    lagging, level = Lagging(), logger.level
    state = ElasticState(model=torch.nn.Linear(2, 1), step=0)
    logger.addHandler(lagging)
    logger.setLevel(logging.INFO)
    restore = state._install_signal_handlers()  # noqa: SLF001 (what run() installs)
    try:
        signal.raise_signal(signal.SIGTERM)
        seen_at_once = state._leave_requested.is_set()  # noqa: SLF001
    finally:
        release.set()
        restore()
        logger.removeHandler(lagging)
        logger.setLevel(level)
    assert seen_at_once, "the SIGTERM was handled but the main thread does not see it yet"


def test_a_sigterm_that_lands_as_the_worker_registers_makes_it_leave_not_die(make_job):
    job = make_job(script=WORKERS / "term_at_registration.py")
    job.start(0)
    assert job.wait_exit(0, timeout=60) == 0, job.tails()
    assert "left with None at step 0" in job.tails(), job.tails()


def test_a_sigterm_to_a_forked_child_ends_the_child_and_never_reaches_the_relay():
    """A DataLoader worker is forked with the trainer's handlers; at shutdown the loader may
    terminate() it. That SIGTERM must end the worker, not make the trainer leave the job."""
    seen: list[signal.Signals] = []
    relayed = threading.Event()

    def on_signal(sig: signal.Signals) -> None:
        seen.append(sig)
        relayed.set()

    restore = relay_signals((signal.SIGTERM,), on_signal, "relay-under-test")
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # the child: says it runs, waits for the parent's word, exits cleanly
            try:
                os.write(ready_w, b"ok")
                os.read(release_r, 1)
            finally:
                os._exit(0)
        # Python drops a signal that lands while the fork is still being set up in the child.
        assert os.read(ready_r, 2) == b"ok"
        os.kill(pid, signal.SIGTERM)
        with os.fdopen(os.pidfd_open(pid), "rb", buffering=0) as child:
            select.select([child], [], [], 10)  # readable once the child ended
        os.write(release_w, b"x")  # a child that outlived its SIGTERM now exits 0
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, (
            f"the child outlived its SIGTERM (wait status {status})")
        signal.raise_signal(signal.SIGTERM)  # the owner's own, after anything the child wrote
        assert relayed.wait(5)
    finally:
        restore()
        for fd in (ready_r, ready_w, release_r, release_w):
            os.close(fd)
    assert seen == [signal.SIGTERM], "the child's signal reached the owner's relay"
