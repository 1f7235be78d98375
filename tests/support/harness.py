"""Real worker processes for the tests: start, watch progress, inject faults, always clean up.

Every process runs in its own session (process group) and is killed by PID when the test ends,
pass or fail. Waits are bounded; progress is read from the files the workers append to.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from elastic.launch.warm_start import ForkedProcess
from tests.support.native_stacks import native_stacks
from tests.support.polling import poll_until
from tests.support.worker_template import WorkerTemplate

WORKER = Path(__file__).resolve().parent.parent / "workers" / "train.py"
REPO = Path(__file__).resolve().parents[2]


def loopback_env() -> dict[str, str]:
    """The environment every test process gets: loopback only."""
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", ELASTIC_ADVERTISE_ADDR="127.0.0.1",
               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def dump_stacks(procs: Iterable[subprocess.Popen[bytes] | ForkedProcess]) -> None:
    """Asks every live process of ``procs`` (workers that registered ``faulthandler`` on
    SIGUSR1, each the leader of its own process group) and the processes they forked
    (DataLoader workers, which inherit the handler) to write their threads' stacks to the
    worker's log."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:  # not a group leader (or it exited meanwhile)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR1)
    for proc in procs:
        try:
            proc.wait(timeout=1)  # gives the dumps time to land; the workers keep running
        except subprocess.TimeoutExpired:
            pass


class Job:
    """A set of worker processes of one elastic job.

    Args:
        etcd_url: the test's etcd.
        out: a directory for logs, progress and results.
        job_id: the job's id in etcd.
        args: arguments for the worker script.
        env: extra environment (ELASTIC_*, FAULTS).
        script: the worker script.
        template: forks the workers (started cold without one, or when it cannot).
    """

    def __init__(self, etcd_url: str, out: Path, job_id: str, args: list[str] | None = None,
                 env: dict[str, str] | None = None, script: Path = WORKER,
                 template: Callable[[], WorkerTemplate | None] | None = None) -> None:
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.args = args or []
        self.script = script
        self.env = loopback_env()
        self.env.update(ELASTIC_ETCD=etcd_url, ELASTIC_JOB_ID=job_id, ELASTIC_LEASE_TTL="2",
                        ELASTIC_LOG_DIR=str(out / "events"), ELASTIC_RENDEZVOUS_TIMEOUT="60")
        self.env.update(env or {})
        self.template = template
        self.procs: dict[int, subprocess.Popen[bytes] | ForkedProcess] = {}

    def start(self, index: int, script: Path | None = None, cold: bool = False,
              **extra_env: str) -> subprocess.Popen[bytes] | ForkedProcess:
        """Starts worker ``index`` (its logs go to ``worker-{index}.log``), running the job's
        script or ``script``: forked from the template when there is one, else cold (``cold``:
        a fresh interpreter anyway, as a worker started by hand or by another launcher)."""
        env = dict(self.env, TEST_WORKER_INDEX=str(index), **extra_env)
        command = [sys.executable, str(script or self.script), "--out", str(self.out), *self.args]
        template = self.template() if self.template is not None and not cold else None
        with open(self.out / f"worker-{index}.log", "ab") as log:
            proc = template.start_worker(command, env, log.fileno()) if template else None
            if proc is None:
                proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[index] = proc
        return proc

    def start_together(self, indices: list[int] | range) -> None:
        """Starts workers that wait for each other before joining (one first round)."""
        for index in indices:
            self.start(index, START_BARRIER=str(len(indices)))

    def progress(self, index: int) -> list[dict[str, Any]]:
        path = self.out / f"progress-{index}.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Waits for ``condition`` with a deadline; fails with the workers' log tails."""
        if poll_until(condition, timeout):
            return
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.tails()}")

    def wait_step(self, index: int, step: int, timeout: float = 60) -> None:
        self.wait_until(lambda: any(p.get("step", 0) >= step and "loss" in p
                                    for p in self.progress(index)),
                        timeout, f"worker {index} to reach step {step}")

    def wait_exit(self, index: int, timeout: float = 120) -> int:
        proc = self.procs[index]
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {index} did not exit in {timeout} s\n"
                                 f"{self.hang_report()}") from None

    def fired(self, kind: str, index: int, timeout: float = 60) -> dict[str, Any]:
        """The marker of a fault that fired, waiting for it: another worker's exit (the usual
        cue to look) can come before this worker has written its marker."""
        marker = self.out / f"fired-{kind}-{index}"
        self.wait_until(marker.exists, timeout, f"fault {kind} on worker {index} to fire")
        return json.loads(marker.read_text())

    def result(self, index: int) -> dict[str, Any]:
        path = self.out / f"result-{index}.json"
        assert path.exists(), f"worker {index} wrote no result\n{self.tails()}"
        return json.loads(path.read_text())

    def events(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted((self.out / "events").glob("*.jsonl")):
            found += [json.loads(line) for line in path.read_text().splitlines() if line]
        return sorted(found, key=lambda e: e["t"])

    def signal(self, index: int, sig: signal.Signals) -> None:
        os.kill(self.procs[index].pid, sig)

    def dump_stacks(self) -> None:
        """Asks every live worker to write its threads' stacks to its log (SIGUSR1)."""
        dump_stacks(self.procs.values())

    def tails(self, lines: int = 25, since: dict[int, int] | None = None) -> str:
        """The last ``lines`` of each worker's log; with ``since`` (log sizes taken before),
        the last ``lines`` before that point and everything written after it."""
        parts = []
        for index in sorted(self.procs):
            path = self.out / f"worker-{index}.log"
            data = path.read_bytes() if path.exists() else b""
            cut = len(data) if since is None else since.get(index, 0)
            text = data[:cut].decode(errors="replace").splitlines()[-lines:]
            text += data[cut:].decode(errors="replace").splitlines()
            parts.append(f"--- worker {index} (rc={self.procs[index].poll()}) ---\n"
                         + "\n".join(text))
        return "\n".join(parts)

    def hang_report(self) -> str:
        """Every live worker's and DataLoader worker's stacks, whole, after each log's tail;
        then their native stacks (``native_stacks``: where a C call hangs)."""
        sizes = {index: path.stat().st_size for index in self.procs
                 if (path := self.out / f"worker-{index}.log").exists()}
        self.dump_stacks()
        live = [proc.pid for proc in self.procs.values() if proc.poll() is None]
        return self.tails(10, since=sizes) + "\n" + native_stacks(live)

    def kill_all(self) -> None:
        """Kills every process this job started (and their process groups), by PID."""
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
