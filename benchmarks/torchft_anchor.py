"""torchft as an anchor of the recovery benchmark: its lighthouse and replica groups, SIGKILL of
one of 4 -> the survivors' next committed step, and a replacement's rejoin and heal.

torchft is optional (``pip install -e '.[bench-torchft]'``; the suite never needs it). Two
series, labelled: ``default`` (the lighthouse's defaults: heartbeat timeout 5 s, join timeout
60 s, quorum tick 100 ms; the manager's and the process group's defaults) and ``low`` (the
lowest its documentation shows: the lighthouse command of its README, ``--join_timeout_ms
10000 --quorum_tick_ms 100``, a heartbeat timeout of 1 s, which its maintainers call fine for
the 100 ms heartbeat in pytorch/torchft issue 35, and ``train_ddp.py``'s 5 s process group and
30 s manager timeouts). Everything binds loopback inside the benchmark's network namespace.

What bounds its recovery, seen in the workers' logs: the survivors next to the dead replica get
a connection reset at once, but one that gets none can wait for its gloo receive to time out (the
process group's timeout: 60 s by default, 5 s in ``low``) before it leaves the step; the new
quorum then forms when the lighthouse stops counting the dead one (its heartbeat timeout).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from harness import Procs, env_for, read_progress, wait_for
from elastic.cluster.links.ports import free_port

SERIES = {
    "default": [],
    "low": ["--heartbeat_timeout_ms", "1000", "--join_timeout_ms", "10000",
            "--quorum_tick_ms", "100"],
}
REPLICAS = 4


def require() -> None:
    """Raises when torchft is not installed, saying how to install it."""
    if importlib.util.find_spec("torchft") is None or shutil.which(lighthouse_bin()) is None:
        raise SystemExit("torchft is not installed in this environment: pip install -e "
                         "'.[bench-torchft]' (an optional extra), or drop --torchft")


def lighthouse_bin() -> str:
    return str(Path(sys.executable).with_name("torchft_lighthouse"))


class TorchftJob:
    """A lighthouse and ``replicas`` replica groups of ``torchft_worker.py``."""

    def __init__(self, out: Path, series: str, replicas: int = REPLICAS,
                 worker_args: tuple[str, ...] = (), procs: Procs | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.out, self.series, self.replicas = out, series, replicas
        self.procs = procs or Procs(out)
        self.env = env_for(**(env or {}))
        port = free_port()
        self.lighthouse = f"http://127.0.0.1:{port}"
        self.procs.start([lighthouse_bin(), "--min_replicas", "1", "--bind",
                          f"127.0.0.1:{port}", *SERIES[series]], env_for(RUST_LOG="warn"))
        self.worker_args = worker_args
        self.workers: dict[int, int] = {}
        for replica in range(replicas):
            self.start(replica)

    def start(self, replica: int) -> int:
        args = [sys.executable, "torchft_worker.py", "--out", str(self.out), "--lighthouse",
                self.lighthouse, "--replica", str(replica), "--replicas", str(self.replicas),
                *self.worker_args, *(["--low"] if self.series == "low" else [])]
        self.workers[replica] = self.procs.start(args, self.env).pid
        return self.workers[replica]

    def close(self) -> None:
        self.procs.kill_all()


def at_step(out: Path, minimum: int, world: int, pids: set[int] | None = None):
    """The pids with a committed step >= ``minimum`` in a quorum of ``world``, when ``world``
    of them have one (only among ``pids`` when given)."""
    have = {p["pid"] for p in read_progress(out) if p["step"] >= minimum and p["world"] == world
            and (pids is None or p["pid"] in pids)}
    return have if len(have) >= world else None


def kill_and_replace(out: Path, series: str) -> dict[str, float]:
    """SIGKILL of replica group 1 of 4 at step 30: seconds to the survivors' first committed
    step in a quorum of 3 (as ours is timed: the first step in the new world); then a replacement started: seconds from its start to its first committed step
    (imports, quorum, heal from a peer, a step), the part of it from its manager's start (rejoin
    and heal), and the survivors' longest pause meanwhile."""
    job = TorchftJob(out, series, worker_args=("--grads", "manager"))
    try:
        wait_for(lambda: at_step(out, 30, REPLICAS), 300, f"4 torchft replicas ({series}) at "
                 "step 30")
        victim = job.workers[1]
        survivors = set(job.workers.values()) - {victim}
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        first = wait_for(lambda: next((p for p in read_progress(out) if p["t"] > killed_at
                                       and p["world"] == REPLICAS - 1), None), 120,
                         f"a committed step of the torchft survivors ({series})")
        wait_for(lambda: at_step(out, first["step"] + 5, REPLICAS - 1, survivors), 120,
                 f"3 torchft survivors ({series}) training")
        started_at = time.time()
        newcomer = job.start(1)
        joined = wait_for(lambda: next((p for p in read_progress(out)
                                        if p["pid"] == newcomer), None), 180,
                          f"the torchft replacement's first committed step ({series})")
        ready = float((out / f"ready-{newcomer}").read_text())
        steps = [p["t"] for p in read_progress(out)
                 if p["pid"] == min(survivors) and started_at <= p["t"] <= joined["t"] + 1]
        pause = max((b - a for a, b in zip(steps, steps[1:])), default=0.0)
        return {"kill_s": first["t"] - killed_at, "first_committed_world": first["world"],
                "replacement_s": joined["t"] - started_at, "rejoin_heal_s": joined["t"] - ready,
                "survivor_max_pause_s": pause}
    finally:
        job.close()


WHAT = ("kill_s", "replacement_s", "rejoin_heal_s", "survivor_max_pause_s")
KEYS = tuple(f"torchft_{series}_{what}" for series in SERIES
             for what in WHAT)


def measure(out: Path) -> dict[str, float]:
    """Both series, one after the other: the figures under ``KEYS``."""
    figures = {}
    for series in SERIES:
        (out / series).mkdir(parents=True, exist_ok=True)
        got = kill_and_replace(out / series, series)
        for what in WHAT:
            figures[f"torchft_{series}_{what}"] = got[what]
    return figures
