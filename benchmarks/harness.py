"""The benchmarks' worker processes and their progress files: what every benchmark that
starts real workers shares (``bench_recovery`` and the benchmarks built on it).

Owns the workers' environment (loopback only), reading their per-step progress lines, waiting
on a condition with a deadline, and starting workers each in a session of its own and killing
them by PID at the end. Imported as ``harness`` (the benchmarks run as scripts from this folder).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

POLL_S = 0.02


def env_for(**extra: str) -> dict[str, str]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               ELASTIC_ADVERTISE_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{REPO}:{HERE}", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def read_progress(out: Path) -> list[dict]:
    lines = []
    for path in out.glob("progress-*.jsonl"):
        lines += [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    return sorted(lines, key=lambda p: p["t"])


def wait_for(predicate, timeout: float, what: str, poll_s: float = POLL_S):
    """``predicate()``'s first true value, asked every ``poll_s`` seconds until ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out waiting for {what}")


class Procs:
    """Processes started by the benchmark, each in its own session; killed by PID at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.out / f"log-{len(self.procs)}.txt", "wb")
        proc = subprocess.Popen(args, env=env, cwd=HERE, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        """SIGTERM first (torchrun then stops its workers, which live in sessions of their own),
        then SIGKILL whatever is left, including every worker pid seen in the progress files."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        for pid in {p["pid"] for p in read_progress(self.out)}:
            if _is_our_worker(pid):
                os.kill(pid, signal.SIGKILL)


def _is_our_worker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"_worker.py" in cmdline and b"--out" in cmdline


def steps_of(out: Path, minimum: int, world: int):
    """The pids that have completed ``minimum`` steps in a world of ``world``, or None."""
    progress = read_progress(out)
    pids = {p["pid"] for p in progress if p["step"] >= minimum and p["world"] == world}
    return pids if len(pids) >= world else None
