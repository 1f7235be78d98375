"""The local worker processes of one launcher: start, watch, signal, and always reap.

Each worker runs in its own session (process group), so that a Ctrl-C in the terminal reaches
only the launcher, which then asks every worker to leave; it dies with the launcher
(``parent_death``). A waiter thread per process sets
``changed`` when the process exits (``waitpid``), not when its output pipes close: a child of
the worker (a shell's background job, a DataLoader worker) may hold them open for long after,
and its lines go on being shown. The launcher waits on that Event, never on a sleep. Stragglers are
killed with their whole process group (DataLoader workers included), by PID.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from elastic.launch.output import OutputTail, WorkerOutput
from elastic.launch.parent_death import die_with_parent
from elastic.launch.warm_start import ForkedProcess, WarmStart

log = logging.getLogger(__name__)


@dataclass
class Worker:
    """One local worker process.

    Attributes:
        local_rank: its slot on this node (``LOCAL_RANK``).
        proc: the process.
        handled: whether the launcher has dealt with its exit.
        tail: its last stderr lines, when its output goes through the launcher.
        reaped: set once it exited and the last of its output was copied.
    """

    local_rank: int
    proc: subprocess.Popen[bytes] | ForkedProcess
    handled: bool = field(default=False)
    tail: OutputTail | None = field(default=None)
    reaped: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def last_error_line(self) -> str:
        """The last line it wrote to stderr ("" when unknown): names a Python error."""
        return self.tail.last_line() if self.tail is not None else ""


class WorkerProcs:
    """Starts and tracks a launcher's worker processes.

    Args:
        command: the worker command line (``python script.py args`` or ``python -m mod args``).
        env: the environment every worker starts from.
        reap: how long a worker killed with SIGKILL gets to be reaped before it is reported as
            a survivor (``Timeouts.reap``).
        drain: how long an exited worker's last output may take to be copied before its exit
            is reported (``Timeouts.drain``).
        output: where the workers' stdout and stderr go, line by line (None: they inherit ours).
    """

    def __init__(self, command: Sequence[str], env: Mapping[str, str], reap: timedelta,
                 drain: timedelta, output: WorkerOutput | None = None) -> None:
        if not command:
            raise ValueError("The worker command is empty.")
        self.command = list(command)
        self.env = dict(env)
        self.reap = reap
        self.drain = drain
        self.output = output
        self.changed = threading.Event()
        self.warm: WarmStart | None = None  # set: workers are forked from its template
        self.workers: list[Worker] = []
        self._lock = threading.Lock()

    def start(self, local_rank: int, extra_env: Mapping[str, str],
              label: str | None = None) -> Worker:
        """Starts one worker with ``extra_env`` on top of the common environment.

        Args:
            local_rank: its slot on this node.
            extra_env: its own variables.
            label: the prefix of its output lines (default ``local{local_rank}``).
        """
        env = {**self.env, **extra_env}
        proc = self._fork(env)
        if proc is None:
            pipe = subprocess.PIPE if self.output is not None else None
            proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=pipe,
                                    stderr=pipe, start_new_session=True,
                                    preexec_fn=die_with_parent())  # noqa: PLW1509 (prctl only)
        tail = None
        if self.output is not None:
            tail = self.output.attach(proc, local_rank, label or f"local{local_rank}")
        worker = Worker(local_rank, proc, tail=tail)
        with self._lock:
            self.workers.append(worker)
        threading.Thread(target=self._wait, args=(worker,), name=f"elastic-wait-{proc.pid}",
                         daemon=True).start()
        log.info("started worker local_rank=%d pid=%d (%s)", local_rank, proc.pid,
                 "forked from the template" if isinstance(proc, ForkedProcess) else "cold")
        return worker

    def _fork(self, env: Mapping[str, str]) -> ForkedProcess | None:
        """A worker forked from the warm-start template, or None: start it cold."""
        if self.warm is None:
            return None
        proc = self.warm.spawn(env, piped=self.output is not None)
        if proc is None:
            self.warm = None  # it said why, once
        return proc

    def _wait(self, worker: Worker) -> None:
        worker.proc.wait()
        if worker.tail is not None:  # its last words are printed before its exit is reported
            worker.tail.join(self.drain.total_seconds())
        worker.reaped.set()
        self.changed.set()

    def running(self) -> list[Worker]:
        with self._lock:
            return [w for w in self.workers if not w.reaped.is_set()]

    def exited(self) -> list[Worker]:
        """Workers that exited and were not handled yet (marks them handled)."""
        with self._lock:
            fresh = [w for w in self.workers if not w.handled and w.reaped.is_set()]
            for worker in fresh:
                worker.handled = True
        return fresh

    def terminate(self, grace: timedelta, cut: threading.Event | None = None) -> None:
        """Sends SIGTERM to every running worker, waits up to ``grace``, then kills the rest.

        SIGTERM goes to the worker alone (an ElasticState worker commits and leaves at its next
        commit; its DataLoader workers must not die first); SIGKILL goes to its process group.
        ``cut`` (a second Ctrl-C) ends the wait at once; whoever sets it also sets ``changed``
        (the launcher's ``StopSignal`` does), which is what the wait wakes on, with each exit.
        """
        for worker in self.running():
            _signal(worker.pid, signal.SIGTERM)
        cut = cut or threading.Event()
        deadline = time.monotonic() + grace.total_seconds()
        while True:
            self.changed.clear()  # before looking: an exit from now on wakes the wait below
            left = deadline - time.monotonic()
            if not self.running() or cut.is_set() or left <= 0:
                break
            self.changed.wait(left)
        for worker in self.running():
            log.warning("worker pid=%d did not leave %s; killing it", worker.pid,
                        "(asked again)" if cut.is_set()
                        else f"within {grace.total_seconds():g} s")
        self.kill()

    def kill(self) -> None:
        """Kills every worker's process group (by the worker's PID) and reaps the workers."""
        with self._lock:
            workers = list(self.workers)
        for worker in workers:
            try:
                os.killpg(worker.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                worker.proc.wait(timeout=self.reap.total_seconds())
            except subprocess.TimeoutExpired:
                log.error("worker pid=%d survived SIGKILL for %g s", worker.pid,
                          self.reap.total_seconds())

    def forget_exited(self) -> None:
        """Drops finished workers (before a new generation of plain workers)."""
        with self._lock:
            self.workers = [w for w in self.workers if not w.reaped.is_set()]


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def describe_exit(returncode: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
