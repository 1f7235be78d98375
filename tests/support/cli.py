"""`elastic` CLI processes for the tests: started in their own sessions, killed by PID after.

Worker PIDs are read from the event files (every worker's ``joined`` event has its pid), so
that the finaliser can kill workers too, and the tests can check that none is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic.launch.warm_start import reap_adopted
from tests.support.harness import loopback_env
from tests.support.polling import poll_until

WORKERS = Path(__file__).resolve().parent.parent / "workers"


class Cli:
    """One `python -m elastic ...` process with its output in a file."""

    def __init__(self, args: list[str], out: Path, name: str, env: dict[str, str] | None = None):
        self.log = out / f"{name}.log"
        full_env = loopback_env()
        for var in ("ELASTIC_ADVERTISE_ADDR", "MASTER_ADDR"):
            full_env.pop(var, None)  # the launcher must set these itself
        full_env.update(env or {})
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "elastic", *args], env=full_env,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.proc.args} did not exit in {timeout} s\n"
                                 f"{self.text()[-3000:]}") from None


def events(log_dir: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(log_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.endswith("}"):
                found.append(json.loads(line))
    return sorted(found, key=lambda e: e["t"])


def worker_pids(log_dir: Path) -> set[int]:
    return {e["pid"] for e in events(log_dir) if e["event"] == "joined" and "pid" in e}


def wait_until(condition: Callable[[], bool], timeout: float, what: str,
               clis: list[Cli] = ()) -> None:
    if poll_until(condition, timeout):
        return
    logs = "\n".join(cli.text()[-2000:] for cli in clis)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def kill_everything(clis: list[Cli], log_dirs: list[Path]) -> None:
    """Kills the CLI processes (their groups) and every worker they started, by PID, and reaps
    those this process adopted."""
    for cli in clis:
        if cli.proc.poll() is None:
            try:
                os.killpg(cli.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            cli.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for log_dir in log_dirs:
        for pid in worker_pids(log_dir) if log_dir.exists() else ():
            if is_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    reap_adopted()  # workers of a killed launcher, adopted when this process is a subreaper
