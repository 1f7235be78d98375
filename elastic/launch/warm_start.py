"""Warm starts: the launcher's side of the template process that forks its workers.

``WarmStart`` starts the template (``elastic.launch.template_process``), waits for it to be
ready, and asks it for each worker: a worker forked from it skips the interpreter's start and
the imports (torch: seconds), so a replacement trains within a second of its predecessor's
death, and a node pays its imports once, not once per worker. The launcher becomes a child
subreaper (``PR_SET_CHILD_SUBREAPER``), so that a forked worker is its child like a cold one:
``ForkedProcess`` reaps it and reads its exit status, and its death kills it
(``PR_SET_PDEATHSIG``). Orphans of its workers are adopted too; ``reap_adopted`` reaps them.
When the template cannot serve (it is unfit, it died, it does not answer), the launcher says so
in one line and starts every later worker cold; nothing else changes.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import IO

from elastic.launch.parent_death import die_with_parent

log = logging.getLogger(__name__)
_PR_SET_CHILD_SUBREAPER = 36
MESSAGE_BYTES = 1 << 20


class ForkedProcess:
    """A worker forked by the template and adopted by this process: the part of
    ``subprocess.Popen`` that the launcher uses (``pid``, ``poll``, ``wait``, the streams).

    Its exit is seen through a pidfd; it is reaped once, under a lock, never by a blocking
    ``waitpid``, so any thread may wait for it.
    """

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """The exit status once it exited, else None (never blocks: ``waitpid`` with WNOHANG)."""
        self._reap()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, as ``Popen.wait`` gives it (-N: killed by signal N).

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        if self.returncode is None:
            ready, _, _ = select.select([self._pidfd], [], [], timeout)
            if ready:
                self._reap()
        if self.returncode is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        return self.returncode

    def _reap(self) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            reaped, status = os.waitpid(self.pid, os.WNOHANG)
            if reaped == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)

    def __del__(self) -> None:
        # Closed only with the object: another thread may be about to wait on it.
        os.close(self._pidfd)


class WarmStart:
    """The template process and its requests.

    Args:
        command: the worker command line.
        env: the template's environment (the workers' common one).
        preload: the modules to import besides ``torch``, ``elastic`` and the script's imports.
        ready_within: how long the template may take to import everything.
        answer_within: how long one fork may take to be answered.
    """

    #: What the template runs (``python -m module FD --cwd DIR [--preload a,b] -- COMMAND``).
    module = "elastic.launch.template_process"

    def __init__(self, command: Sequence[str], env: Mapping[str, str], preload: Sequence[str],
                 ready_within: timedelta, answer_within: timedelta) -> None:
        self.command = list(command)
        self.env = dict(env)
        self.preload = list(preload)
        self.ready_within = ready_within
        self.answer_within = answer_within
        self.process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None

    @property
    def serving(self) -> bool:
        return self._control is not None

    def start(self) -> None:
        """Starts the template; it imports meanwhile (see ``wait_ready``)."""
        if not _become_subreaper():
            self._give_up("this system does not let the launcher adopt forked workers")
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        preload = ["--preload", ",".join(self.preload)] if self.preload else []
        with theirs:
            try:
                cwd = os.getcwd()
                self.process = subprocess.Popen(
                    [sys.executable, "-m", self.module, str(theirs.fileno()), "--cwd", cwd,
                     *preload, "--", *self.command], env=_anchored_pythonpath(self.env, cwd),
                    pass_fds=(theirs.fileno(),), cwd=_package_root(), stdin=subprocess.DEVNULL,
                    start_new_session=True, preexec_fn=die_with_parent())  # noqa: PLW1509
            except OSError as exc:  # the cwd is gone, or the package is not in a folder
                ours.close()
                self._give_up(f"the template could not be started ({exc})")
                return
        self._control = ours

    def wait_ready(self) -> bool:
        """Waits for the template's imports; True when it serves (else it said why, once)."""
        reply = self._receive(self.ready_within)
        if reply is None:
            return False
        if "unfit" in reply:
            self._give_up(f"the template cannot be forked from: {reply['unfit']}")
            return False
        # The worker reports a failing import itself, in its one line; here only its name.
        failed = sorted(dict(reply.get("skipped", {})))
        skipped = (f"; not preloaded, since importing failed: {', '.join(failed)}"
                   if failed else "")
        pid = self.process.pid if self.process is not None else 0
        _say(f"warm start: a template (pid {pid}) imported {', '.join(reply['ready'])} in "
             f"{float(reply['took_s']):.1f} s; workers are forked from it{skipped}")
        return True

    def spawn(self, env: Mapping[str, str], piped: bool) -> ForkedProcess | None:
        """Forks a worker with ``env`` (``piped``: its stdout and stderr come back through
        pipes, else they are ours); None when the template cannot (then it serves no more)."""
        pipes = [os.pipe(), os.pipe()] if piped else []
        try:
            pid = self.fork(env, [w for _, w in pipes] if piped else [1, 2])
        finally:
            for _, w in pipes:
                os.close(w)
        if pid is None:
            for r, _ in pipes:
                os.close(r)
            return None
        streams = [os.fdopen(r, "rb") for r, _ in pipes] or [None, None]
        return ForkedProcess(pid, streams[0], streams[1])

    def fork(self, env: Mapping[str, str], outputs: Sequence[int]) -> int | None:
        """Asks the template for a worker with ``env`` whose stdout and stderr are the
        descriptors ``outputs`` (they stay open here); its pid, or None when the template
        cannot (then it serves no more)."""
        if self._control is None:
            return None
        stdin = os.open(os.devnull, os.O_RDONLY)
        try:
            socket.send_fds(self._control, [json.dumps({"env": dict(env)}).encode()],
                            [stdin, *outputs])
        except OSError as exc:
            self._give_up(f"the template is gone ({exc})")
        finally:
            os.close(stdin)
        reply = self._receive(self.answer_within) if self._control is not None else None
        if reply is None or "pid" not in reply:
            if reply is not None:
                self._give_up(f"the template could not fork: {reply.get('error')}")
            return None
        return int(reply["pid"])

    def close(self) -> None:
        """Ends the template (closing the socket ends it; killed after ``answer_within``)."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if self.process is not None:
            try:
                self.process.wait(self.answer_within.total_seconds())
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _receive(self, within: timedelta) -> dict[str, object] | None:
        assert self._control is not None
        ready, _, _ = select.select([self._control], [], [], within.total_seconds())
        data = b""
        if ready:
            try:
                data = self._control.recv(MESSAGE_BYTES)
            except OSError:
                data = b""
        if not data:
            what = self._exit_status() or f"no answer within {within.total_seconds():g} s"
            self._give_up(f"the template is gone ({what})")
            return None
        return json.loads(data)

    def _exit_status(self) -> str | None:
        code = None if self.process is None else self.process.poll()
        if code is None:
            return None
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _give_up(self, why: str) -> None:
        """Stops using the template, in one line; later workers start cold."""
        _say(f"warm start off: {why}; workers start cold (a new Python process each)")
        if self._control is not None:
            self._control.close()
            self._control = None
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _package_root() -> str:
    """The folder this ``elastic`` package was imported from: the template starts there, so
    ``-m`` finds the launcher's own package, not a folder named ``elastic`` in the user's cwd
    (the template goes to that cwd before it imports anything else)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _anchored_pythonpath(env: Mapping[str, str], cwd: str) -> dict[str, str]:
    """``env`` with the entries of ``PYTHONPATH`` made absolute against ``cwd``: an interpreter
    makes them absolute against the folder it starts in, which for the template is not the
    user's, and workers inherit the template's path."""
    path = env.get("PYTHONPATH")
    if not path:
        return dict(env)
    return {**env, "PYTHONPATH": os.pathsep.join(os.path.join(cwd, entry)
                                                 for entry in path.split(os.pathsep))}


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # noqa: PLC0415
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1) == 0


def reap_adopted() -> list[int]:
    """Reaps the exited orphans this subreaper adopted from its workers (a DataLoader worker
    outliving its worker): zombies among its children that lead no session of their own and
    are not in this process's session, so never a process it started itself (those lead
    their own session, or share ours and are reaped by their ``Popen``)."""
    ours = os.getsid(0)
    reaped = []
    for pid in _children():
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, session = fields[0], int(fields[3])
        if state == "Z" and session not in (pid, ours):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            reaped.append(pid)
    return reaped


def _children() -> set[int]:
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children", encoding="utf-8") as children:
                found |= {int(pid) for pid in children.read().split()}
        except OSError:
            continue
    return found


def _say(message: str) -> None:
    print(f"elastic: {message}", file=sys.stderr, flush=True)
