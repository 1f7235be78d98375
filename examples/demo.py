"""What `make demo` runs: an elastic job that loses a worker and gains one, and keeps training.

``--fsdp`` (`make demo-fsdp`) runs the FSDP2 language model (examples/fsdp_lm.py, tiny) instead
of the digits, with a checkpoint directory: its shards are resharded in memory at each change,
and every epoch ends with a durable sharded checkpoint.

1. starts an etcd on 127.0.0.1 and `elastic run -n 3 examples/digits_elastic.py`;
2. SIGKILLs one worker mid-run: its launcher revokes its lease, the survivors re-form in world 2
   and carry on from the last commit, and the launcher restarts the worker (it rejoins);
3. starts one more worker as another terminal would: `elastic run --etcd URL --job-id ID -n 1`;
4. prints a summary (world size over time, each recovery's duration, final accuracy) and writes
   the timeline picture with `elastic report`. Every process it started is gone at the end.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from elastic.launch.embedded_etcd import EmbeddedEtcd
from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from elastic.launch.report import build_timeline, load_events, plot
from elastic.launch.status import collect

HERE = Path(__file__).resolve().parent
SCRIPT = [str(HERE / "digits_elastic.py"), "--epochs", "20", "--step-ms", "60"]
FSDP_SCRIPT = [str(HERE / "fsdp_lm.py"), "--size", "tiny", "--epochs", "3", "--text-bytes",
               "60000", "--step-ms", "30"]
PROGRESS = re.compile(r"epoch (\d+) step (\d+) world (\d+) loss ([\d.]+)")
WORKER_PREFIX = re.compile(r"^\[(?:local|rank)\d+\]: ")  # the launcher's per-worker prefix


class Watcher:
    """Reads a launcher's output: shows progress, remembers the world size and the accuracy."""

    def __init__(self) -> None:
        self.step, self.world, self.accuracy = 0, 0, None
        self.changed = threading.Event()

    def follow(self, proc: subprocess.Popen, name: str) -> None:
        threading.Thread(target=self._read, args=(proc, name), daemon=True).start()

    def _read(self, proc: subprocess.Popen, name: str) -> None:
        for raw in proc.stdout:
            line = WORKER_PREFIX.sub("", raw.decode(errors="replace").rstrip())
            match = PROGRESS.search(line)
            if match:
                epoch, step, world, loss = match.groups()
                if int(world) != self.world:
                    print(f"[{name}] world size is now {world}")
                self.step, self.world = int(step), int(world)
                if self.step % 40 == 0:
                    print(f"  epoch {epoch:>2}  step {step:>4}  world {world}  loss {loss}")
            elif line.startswith("final accuracy"):
                self.accuracy = float(line.split()[-1])
            elif line.startswith(("elastic:", "    elastic run")) or "Error" in line:
                print(f"[{name}] {line}")
            self.changed.set()

    def wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the demo waited {timeout:.0f} s for {what}")
            self.changed.wait(timeout=0.5)
            self.changed.clear()


def launch(etcd: str, job: str, logs: Path, n: int, script: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "elastic", "run", "--etcd", etcd, "--job-id", job,
               "-n", str(n), "--max-restarts", "1", "--log-dir", str(logs), *script]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def kill_one_worker(etcd: str, job: str) -> int:
    """SIGKILLs the worker with the highest rank of the current round; returns its PID."""
    client = EtcdClient(etcd)
    try:
        status = collect(client, JobKeys(job))
    finally:
        client.close()
    victim = status["plan"]["ranks"][-1]
    pid = next(m["pid"] for m in status["members"] if m["member"] == victim)
    os.kill(pid, signal.SIGKILL)
    return pid


def summary(logs: Path, accuracy: float | None, started: float) -> None:
    timeline = build_timeline(load_events(logs))
    worlds = [r.world_size for r in timeline.rounds]
    path = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    print("\n=== summary ===")
    print(f"world size over time: {' -> '.join(map(str, path))}")
    for r in timeline.rounds:
        if r.recovery_s is not None:
            print(f"recovery at {r.t:5.1f} s: {r.recovery_s:.2f} s from failure to resumed "
                  f"training in world {r.world_size}")
    if accuracy is not None:  # the digits; the FSDP language model prints its loss instead
        print(f"final accuracy on held-out digits: {accuracy}")
    print(f"wall time: {time.monotonic() - started:.0f} s")
    plot(timeline, logs / "report.png")
    print(f"timeline: {logs / 'report.png'}  (also: elastic report {logs})")


def stop(procs: list[subprocess.Popen]) -> None:
    """Asks every launcher still running to stop (they stop their workers), bounded."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def main() -> int:
    started = time.monotonic()
    logs = Path(tempfile.mkdtemp(prefix="elastic-demo-")) / "events"
    logs.mkdir(parents=True)
    script = SCRIPT
    if "--fsdp" in sys.argv[1:]:
        script = ["--checkpoint", str(logs.parent / "checkpoints"), *FSDP_SCRIPT]
    job = f"demo-{uuid.uuid4().hex[:6]}"
    watcher = Watcher()
    procs: list[subprocess.Popen] = []
    with EmbeddedEtcd() as etcd:
        try:
            print(f"etcd on {etcd.url}; starting 3 workers of job {job}")
            procs.append(launch(etcd.url, job, logs, 3, script))
            watcher.follow(procs[0], "node A")
            watcher.wait_for(lambda: watcher.step >= 60, 90, "training to reach step 60")
            pid = kill_one_worker(etcd.url, job)
            print(f"*** SIGKILL to worker pid {pid}")
            watcher.wait_for(lambda: watcher.world == 2, 60, "the survivors to re-form")
            procs.append(launch(etcd.url, job, logs, 1, script))
            print(f"*** adding a worker: {shlex.join(['elastic', *procs[1].args[3:]])}")
            watcher.follow(procs[1], "node B")
            codes = [proc.wait(timeout=150) for proc in procs]
            print(f"launchers exited with {codes}")
        finally:
            stop(procs)
    summary(logs, watcher.accuracy, started)
    return 0 if all(p.returncode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
