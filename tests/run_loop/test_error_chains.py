"""The package's errors reach a script run with plain ``python`` as their message alone: no
chain of the third-party errors behind them, which stays in the event log and comes back with
``ELASTIC_DEBUG=1``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.cluster.links.ports import free_port
from tests.support.cli import WORKERS
from tests.support.harness import loopback_env

pytestmark = pytest.mark.timeout(120)


def run_against_dead_etcd(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {**loopback_env(), "ELASTIC_ETCD": f"http://127.0.0.1:{free_port()}",
           "ELASTIC_JOB_ID": "dead-etcd", "ELASTIC_ETCD_RETRY": "3",
           "ELASTIC_LOG_DIR": str(tmp_path / "events"), **extra}
    return subprocess.run([sys.executable, str(WORKERS / "newcomer.py")], env=env,
                          capture_output=True, text=True, timeout=100)


def test_an_etcd_error_raised_into_the_script_has_no_chained_traceback(tmp_path):
    done = run_against_dead_etcd(tmp_path)
    assert done.returncode == 1
    assert "EtcdUnavailableError: etcd at http://127.0.0.1:" in done.stderr, done.stderr
    assert "direct cause" not in done.stderr and "During handling" not in done.stderr, done.stderr
    assert done.stderr.count("Traceback") == 1, done.stderr
    assert len(done.stderr.splitlines()) <= 8, done.stderr  # was 90 (three tracebacks)
    causes = [json.loads(line) for path in (tmp_path / "events").glob("*.jsonl")
              for line in path.read_text().splitlines() if '"error"' in line]
    assert causes and "ConnectionFailedError" in causes[-1]["causes"], causes


def test_elastic_debug_keeps_the_whole_chain_of_causes(tmp_path):
    done = run_against_dead_etcd(tmp_path, ELASTIC_DEBUG="1")
    assert done.returncode == 1
    assert "direct cause" in done.stderr and "ConnectionFailedError" in done.stderr, done.stderr
