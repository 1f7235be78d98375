"""What the launcher says when a worker exits with an error: which way the hint points."""

from __future__ import annotations

import os
import re

import pytest

from tests.support.cli import WORKERS

pytestmark = pytest.mark.timeout(120)
FAILS = str(WORKERS / "fails.py")


def launcher_lines(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if re.match(r"elastic: worker local_rank=0 \(\S+:pid \d+\) ", line)]


def test_a_worker_that_joined_trained_and_then_raised_is_not_called_one_that_never_joined(
        cli, etcd):
    run = cli("run", "--etcd", etcd.url, "--job-id", f"joined-{os.getpid()}",
              "--max-restarts", "0", FAILS, "--when", "train")
    assert run.wait(90) == 1, run.text()
    [line] = launcher_lines(run.text())
    assert "failed (exit code 1) after it had joined the job and left it" in line
    assert "before it joined" not in run.text() and "--plain" not in run.text()


def test_a_worker_that_fails_before_joining_gets_the_plain_mode_hint(cli, etcd):
    run = cli("run", "--etcd", etcd.url, "--job-id", f"unjoined-{os.getpid()}",
              "--max-restarts", "0", FAILS, "--when", "import")
    assert run.wait(90) == 1, run.text()
    [line] = launcher_lines(run.text())
    assert "failed (exit code 1) before it joined the job" in line
    assert "elastic run --plain" in line
