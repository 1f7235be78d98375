"""The launcher sees a worker's exit when the process exits, not when its output pipes close."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.support.cli import WORKERS, is_alive, wait_until

pytestmark = pytest.mark.timeout(120)
LEAVES_CHILD = str(WORKERS / "leaves_child.py")


def test_a_killed_worker_whose_child_keeps_its_output_open_is_revoked_at_once(
        cli, etcd, tmp_path: Path):
    os.mkfifo(tmp_path / "go")
    run = cli("run", "--etcd", etcd.url, "--job-id", f"child-{os.getpid()}",
              "--max-restarts", "1", LEAVES_CHILD, str(tmp_path),
              env={"ELASTIC_DEBUG": "1"})  # the revoked lease on the death line
    try:
        wait_until(lambda: (tmp_path / "killed").exists(), 90, "the worker to kill itself",
                   [run])
        # The child holds the worker's output pipes open until the test writes to "go", which
        # it does only after the revoke: a launcher that waited for the pipes to close would
        # never revoke, and this wait (a hang guard) fails.
        wait_until(lambda: "died (SIGKILL); revoked its lease" in run.text(), 30,
                   "the launcher to revoke the lease", [run])
        assert "own error" not in run.text()
        child = int((tmp_path / "child.pid").read_text())
        with open(tmp_path / "go", "w") as go:  # the child prints only after the revoke
            go.write("now\n")
        wait_until(lambda: "child-output-after-death" in run.text(), 30,
                   "the dead worker's child's output to be shown", [run])
        text = run.text()
        assert text.index("died (SIGKILL); revoked") < text.index("child-output-after-death")
        assert run.wait(90) == 0, run.text()
    finally:
        pid_file = tmp_path / "child.pid"
        if pid_file.exists() and is_alive(child := int(pid_file.read_text())):
            os.kill(child, signal.SIGKILL)
