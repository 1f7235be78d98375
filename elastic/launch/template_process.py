"""The warm-start template: a process that imports the worker's modules once and forks workers.

``elastic run`` starts ``python -m elastic.launch.template_process FD --cwd DIR [--preload a,b]
-- COMMAND`` in the folder its own ``elastic`` package came from (DIR is its cwd, where the
template goes first), with one end of a ``SOCK_SEQPACKET`` socket pair at descriptor FD
(``multiprocessing``'s fork server is the model). The template imports
``elastic.launch.preload``'s list, checks that it is fit to fork (``unfit``: one thread, no
CUDA context, no socket but its own) and says
``{"ready": ...}`` or ``{"unfit": why}``. Then, per request ``{"env": {...}}`` carrying three
descriptors (the worker's stdin, stdout, stderr), it forks twice: the middle process exits at
once, so the worker is adopted by the launcher (a child subreaper), which reaps it and gets its
exit status like any child's. The answer is ``{"pid": N}`` or ``{"error": why}``. The socket's
end (the launcher closed it or died) ends the template.

What a worker does not share with the template (``_become_worker``): descriptors (only its
three streams, and whatever the preloaded modules opened, as in a fresh process), signal
handlers and mask (a fresh interpreter's), the session (its own, like a cold worker's), the
random generators (``random``, ``numpy`` and ``torch`` seeded afresh, as a fresh process seeds
them), the environment (the one the launcher sent, and fsspec's settings read from it at import:
``FSSPEC_*``), ``sys.argv`` and ``sys.orig_argv`` (the
worker command's, so a restart in place runs the script). Threads and CUDA cannot be shared:
the template has none when it forks. The worker then returns from ``main`` and runs the script
at the top level of this module, so its exit is an interpreter's exit (atexit, tracebacks).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from types import TracebackType

from elastic.foundation.timeouts import Timeouts
from elastic.launch.preload import ALWAYS, module_file, parse_preload, script_imports

#: The largest message either side sends (a worker's environment).
MESSAGE_BYTES = 1 << 20
_PR_SET_PDEATHSIG = 1
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it and pages stay shared


@dataclass(frozen=True)
class WorkerRun:
    """The worker command a forked worker runs: ``python script args`` or ``python -m mod``."""

    command: tuple[str, ...]

    @property
    def module(self) -> str | None:
        return self.command[2] if self.command[1] == "-m" else None

    @property
    def argv(self) -> list[str]:
        """``sys.argv`` as the interpreter sets it for the command."""
        if self.module is not None:
            return [module_file(self.module) or self.module, *self.command[3:]]
        return list(self.command[1:])

    def path_entry(self) -> str:
        """``sys.path[0]`` as the interpreter sets it: the script's folder, or the cwd."""
        if self.module is not None:
            return os.getcwd()
        return os.path.dirname(os.path.realpath(self.command[1]))

    def imports(self) -> list[str]:
        source = module_file(self.module) if self.module is not None else self.command[1]
        return script_imports(source) if source else []

    def run(self) -> None:
        """Runs the command in this process as the interpreter would run it; an error it raises
        is printed as the interpreter prints it (from the script's frame on), exit status 1."""
        sys.argv = self.argv
        sys.orig_argv = list(self.command)
        try:
            if self.module is not None:
                runpy.run_module(self.module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(os.path.abspath(self.command[1]), run_name="__main__")
        except Exception as exc:  # noqa: BLE001 (the user's script: reported as Python would)
            traceback.print_exception(type(exc), exc, _users_frames(exc.__traceback__))
            sys.exit(1)


def _users_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without its first frames that are this module's or runpy's."""
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def preload(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Imports ``names``; returns those imported and, for the others, why not.

    The template runs the user's code here; whatever it raises is the user's, and a fresh
    worker meets it again and reports it, so it is only noted.
    """
    loaded, skipped = [], {}
    for name in dict.fromkeys(names):
        try:
            __import__(name)
        except Exception as exc:  # noqa: BLE001 (the user's import; the worker reports it)
            skipped[name] = f"{type(exc).__name__}: {exc}"[:200]
        else:
            loaded.append(name)
    return loaded, skipped


def quiet_blas() -> None:
    """Ends OpenBLAS's thread pool (numpy starts one at import), as its own fork handler would;
    the pool starts again in a worker at its first use."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    for path in sorted(paths):
        shutdown = getattr(ctypes.CDLL(path), "blas_thread_shutdown_", None)
        if shutdown is not None:
            shutdown()


def unfit(control: int) -> str | None:
    """Why this process must not be forked from (None: it may): threads, CUDA, sockets."""
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        return f"it runs {len(threads)} threads after the imports (a fork copies only one)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "an import initialised CUDA (a CUDA context cannot be forked)"
    for fd in open_fds():
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if fd != control and target.startswith("socket:"):
            return f"an import opened a socket (descriptor {fd})"
    return None


def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def _fresh_signals() -> dict[int, object]:
    return {sig: signal.getsignal(sig) for sig in signal.valid_signals()
            if sig not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(sig) is not None}


class Template:
    """The serving side; see the module docstring.

    Args:
        control: the socket to the launcher.
        run: the worker command.
    """

    def __init__(self, control: socket.socket, run: WorkerRun) -> None:
        self.control = control
        self.run = run
        self.signals = _fresh_signals()  # a fresh interpreter's, before anything is imported
        self.inherited = open_fds()  # the launcher's: closed in every worker
        self.launcher = os.getppid()

    def serve(self, extra: tuple[str, ...]) -> WorkerRun | None:
        """Preloads, then forks a worker per request until the socket ends; returns the worker
        command in a forked worker, None in the template when it is done."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we end
        sys.path[0] = self.run.path_entry()
        started = time.monotonic()
        loaded, skipped = preload([*ALWAYS, *self.run.imports(), *extra])
        quiet_blas()
        gc.collect()
        gc.freeze()  # the collector never visits (so never copies) the imports' pages in a worker
        why = unfit(self.control.fileno())
        self._send({"unfit": why} if why else
                   {"ready": loaded, "skipped": skipped, "took_s": time.monotonic() - started})
        while not why:
            try:
                data, fds, _, _ = socket.recv_fds(self.control, MESSAGE_BYTES, 3)
            except OSError:
                return None
            if not data:
                return None
            why = unfit(self.control.fileno())
            if why or len(fds) != 3:
                for fd in fds:
                    os.close(fd)
                self._send({"error": why or f"{len(fds)} descriptors came, not 3"})
                continue
            if self._fork(json.loads(data)["env"], fds):
                return self.run
        return None

    def _send(self, message: dict[str, object]) -> None:
        try:
            self.control.send(json.dumps(message).encode())
        except OSError:
            pass  # the launcher is gone; the next receive ends the template

    def _fork(self, env: dict[str, str], fds: list[int]) -> bool:
        """Forks one worker; True in the worker."""
        read_end, write_end = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(read_end)
            middle = os.getpid()
            worker = os.fork()
            if worker == 0:
                os.close(write_end)
                self._become_worker(env, fds, middle)
                return True
            os.write(write_end, str(worker).encode())
            os._exit(0)
        os.close(write_end)
        for fd in fds:
            os.close(fd)
        with os.fdopen(read_end, "rb") as pid_pipe:
            pid = pid_pipe.read()
        os.waitpid(middle, 0)  # reaped: the worker has been adopted by the launcher
        self._send({"pid": int(pid)} if pid else {"error": "the second fork failed"})
        return False

    def _become_worker(self, env: dict[str, str], fds: list[int], middle: int) -> None:
        """Turns this forked child (of process ``middle``) into a worker that shares nothing it
        must not."""
        os.setsid()  # first: the launcher reaps only orphans outside their own session
        _adopted_by(self.launcher, middle)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        self.control.close()
        for fd in (self.inherited | set(fds)) - {0, 1, 2}:
            try:
                os.close(fd)
            except OSError:
                continue
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for sig, handler in self.signals.items():
            try:
                signal.signal(sig, handler)  # type: ignore[arg-type]
            except (OSError, ValueError):
                continue
        os.environ.clear()
        os.environ.update(env)
        os.environ["ELASTIC_STARTED_FROM"] = "template"
        _reread_config()
        _reseed()
        _own_pages()


def _adopted_by(launcher: int, middle: int) -> None:
    """Waits (bounded) until the middle process is gone and the launcher adopted this one, and
    has this process killed when the launcher dies, as a cold worker is."""
    try:
        pidfd = None if os.getppid() == launcher else os.pidfd_open(middle)
    except ProcessLookupError:
        pidfd = None  # gone and reaped already: the adoption is done
    if pidfd is not None:
        select.select([pidfd], [], [], Timeouts.from_env().fork.total_seconds())
        os.close(pidfd)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher:  # the launcher died, or did not adopt us
        os._exit(1)


def _own_pages() -> None:
    """Copies every page shared with the template now (``MADV_POPULATE_WRITE``): otherwise
    each is copied on its first write, and refcounts write to every object a code path
    touches, so the first recovery of a forked worker, code never run before, paid for
    thousands of page copies. Private writable mappings only: what a cold worker owns too."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            if perms[1] == "w" and perms[3] == "p":
                start, end = (int(x, 16) for x in span.split("-"))
                libc.madvise(start, end - start, _MADV_POPULATE_WRITE)  # best effort


def _reread_config() -> None:
    """Reads again the settings fsspec read from the environment at its import (``FSSPEC_*``
    and its config folder), as a fresh process reads them from its own environment."""
    config = sys.modules.get("fsspec.config")
    if config is not None:
        config.conf.clear()
        config.conf_dir = os.environ.get("FSSPEC_CONFIG_DIR", config.default_conf_dir)
        config.set_conf_files(config.conf_dir, config.conf)
        config.set_conf_env(config.conf)


def _reseed() -> None:
    """Seeds the generators a fresh process seeds from the OS (``random`` is re-seeded by its
    own fork hook)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def parse_arguments(argv: list[str]) -> tuple[socket.socket, dict[str, str], WorkerRun]:
    """``FD --cwd DIR [--preload a,b] -- COMMAND``: the control socket, the options, the worker
    command. Goes to DIR (the launcher's cwd, which the workers keep): the launcher started
    this process in its own package's folder, so ``-m`` imported the package it runs."""
    split = argv.index("--")
    options = dict(zip(argv[1:split:2], argv[2:split:2], strict=True))
    os.chdir(options["--cwd"])
    return socket.socket(fileno=int(argv[0])), options, WorkerRun(tuple(argv[split + 1:]))


def main(argv: list[str]) -> WorkerRun | None:
    control, options, run = parse_arguments(argv)
    extra = parse_preload(options["--preload"]) if "--preload" in options else ()
    return Template(control, run).serve(extra)


if __name__ == "__main__":
    _worker = main(sys.argv[1:])
    if _worker is not None:
        _worker.run()  # at the top level: the script's exit is the interpreter's
