"""What a restart in place keeps and lets go, in a real child process that execs itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

CHILD = textwrap.dedent("""
    import json, os, socket, subprocess, sys, time
    from datetime import timedelta
    from multiprocessing import resource_tracker, shared_memory
    from elastic.cluster.links.restart_in_place import restart_in_place
    if os.environ.get("RESTARTED"):
        links = []
        for name in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{name}"))
            except OSError:
                pass  # the listing's own descriptor, closed by now
        print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "t": time.monotonic(),
                          "sockets": [link for link in links if link.startswith("socket:")],
                          "round": {k: os.environ.get(k) for k in
                                    ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
                          "local_rank": os.environ.get("LOCAL_RANK")}))
        sys.exit(0)
    os.environ["RESTARTED"] = "1"
    os.environ.update(RANK="2", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                      LOCAL_RANK="1")  # the round's (the run loop's), and the launcher's
    leaked = socket.socket()  # made inheritable, as gloo's sockets are
    leaked.set_inheritable(True)
    segment = shared_memory.SharedMemory(create=True, size=4096)  # the tracker now runs
    parent = subprocess.Popen([sys.executable, "-c", (
        "import signal, subprocess, sys; "
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()']); "
        "print(grandchild.pid, flush=True); signal.pause()")], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)  # a grandchild left must not hold the test's pipe
    grandchild = int(parent.stdout.readline())
    fake_tracker = None
    if os.environ.get("DEAF_TRACKER"):  # a tracker that never exits when its pipe ends
        read_end, write_end = os.pipe()
        fake_tracker = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"],
                                        pass_fds=(read_end,))
        resource_tracker._resource_tracker._fd = write_end
        resource_tracker._resource_tracker._pid = fake_tracker.pid
    print(json.dumps({"pid": os.getpid(), "leaked": leaked.fileno(), "shm": segment.name,
                      "children": [parent.pid, grandchild], "t": time.monotonic(),
                      "fake_tracker": fake_tracker and fake_tracker.pid}), flush=True)
    restart_in_place(timedelta(seconds=float(os.environ["END_WITHIN_S"])))
""")


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def restart(env: dict[str, str] | None = None) -> tuple[dict, dict, str]:
    """Runs CHILD, which restarts in place once; returns what it said before and after, and
    its stderr. Ends by pid whatever of its tree outlived it."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "END_WITHIN_S": "5", **(env or {})}
    done = subprocess.run([sys.executable, "-c", CHILD, "--flag", "value"], env=env,
                          capture_output=True, text=True, timeout=50)
    lines = done.stdout.splitlines()
    before = json.loads(lines[0])
    for pid in before["children"] + [before["fake_tracker"]]:
        if pid and is_running(pid):
            os.kill(pid, signal.SIGKILL)  # the test's own grandchildren, left by a failure
    assert done.returncode == 0 and len(lines) == 2, done.stderr
    return before, json.loads(lines[1]), done.stderr


@pytest.fixture(scope="module")
def restarted() -> tuple[dict, dict, str]:
    before, after, stderr = restart()
    shm = Path("/dev/shm") / before["shm"].lstrip("/")
    left = shm.exists()
    if left:
        shm.unlink()  # the test's own segment, left by a failure
    return before, dict(after, shm_left=left), stderr


def test_a_restart_in_place_keeps_pid_and_command_and_ends_children_and_inherited_sockets(
        restarted):
    before, after, stderr = restarted
    assert after["pid"] == before["pid"]
    assert after["argv"] == ["--flag", "value"]
    assert after["sockets"] == []
    assert not is_running(before["children"][0])
    assert "Traceback" not in stderr


def test_a_restart_in_place_ends_the_children_of_its_children():
    before, _, _ = restart()
    assert not is_running(before["children"][1]), "a grandchild outlived the restart"


def test_a_restart_in_place_lets_the_resource_tracker_unlink_the_users_shared_memory(
        restarted):
    before, after, _ = restarted
    assert not after["shm_left"], f"{before['shm']} was left in /dev/shm"


def test_the_restarted_run_starts_without_the_old_rounds_variables(restarted):
    _, after, _ = restarted
    assert after["round"] == dict.fromkeys(("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    assert after["local_rank"] == "1", "the launcher's LOCAL_RANK is the process's own"


def test_a_resource_tracker_that_never_exits_holds_the_restart_only_for_the_bound():
    before, after, _ = restart({"DEAF_TRACKER": "1", "END_WITHIN_S": "1"})
    assert not is_running(before["fake_tracker"])
    assert after["t"] - before["t"] < 1 + 1 + 5  # two bounded waits, then the interpreter
