"""Errors no restart can fix: one line naming cause and fix, nothing retried, no traceback.

Each case runs the real console command and bounds what it prints, so that a regression to a
page of tracebacks (the issue counted 227 to 850 lines) fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from tests.support.cli import WORKERS
from tests.support.harness import REPO

pytestmark = pytest.mark.timeout(120)
WORKER = str(WORKERS / "elastic_worker.py")


def printed_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def assert_one_line_before_any_worker(text: str, *needles: str) -> None:
    lines = printed_lines(text)
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{text}"
    assert "Traceback" not in text and "started job" not in text, text
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


def test_an_s3_checkpoint_without_s3fs_installed_stops_before_any_worker_naming_the_package(
        cli, tmp_path):
    shadow = tmp_path / "no-s3fs"
    (shadow / "s3fs").mkdir(parents=True)
    (shadow / "s3fs" / "__init__.py").write_text("raise ImportError('s3fs is not installed')\n")
    run = cli("run", "--checkpoint", "s3://bucket/run-7", WORKER,
              env={"PYTHONPATH": f"{shadow}{os.pathsep}{REPO}"})
    assert run.wait(60) == 1
    assert_one_line_before_any_worker(run.text(), "--checkpoint s3://bucket/run-7",
                                      "fsspec backend for 's3'", "s3fs")


def test_an_s3_checkpoint_without_credentials_stops_before_any_worker_saying_what_to_set(
        cli, tmp_path, monkeypatch):
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    run = cli("run", "--checkpoint", "s3://bucket/run-7", WORKER,
              env={"HOME": str(tmp_path), "AWS_EC2_METADATA_DISABLED": "true",
                   "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                   "AWS_CONFIG_FILE": str(tmp_path / "none")})
    assert run.wait(60) == 1
    assert_one_line_before_any_worker(run.text(), "No credentials for checkpoint storage",
                                      "NoCredentialsError", "AWS_ACCESS_KEY_ID")


def test_a_checkpoint_location_that_cannot_be_written_stops_before_any_worker(cli, tmp_path):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a directory")
    run = cli("run", "--checkpoint", str(in_the_way / "run-7"), WORKER)
    assert run.wait(60) == 1
    assert_one_line_before_any_worker(run.text(), "is not writable",
                                      "Choose a --checkpoint this user can create files in")


def test_a_writable_checkpoint_location_passes_the_check_and_keeps_no_probe(tmp_path):
    from elastic.checkpoint import check_writable
    check_writable(str(tmp_path / "run-7"))
    assert [p.name for p in Path(tmp_path / "run-7").iterdir()] == []


def test_a_dead_embedded_etcd_ends_the_run_at_once_in_one_line_instead_of_retrying(
        cli, tmp_path):
    from tests.launch.test_run import etcd_processes_on, resumed_worlds
    from tests.support.cli import wait_until

    log_dir = tmp_path / "events"
    run = cli("run", "-n", "2", "--log-dir", str(log_dir), WORKER, "--steps", "100000")
    wait_until(lambda: 2 in resumed_worlds(log_dir), 60, "world 2", [run])
    port = int(re.search(r"--etcd http://127\.0\.0\.1:(\d+)", run.text()).group(1))
    [server] = etcd_processes_on(port)
    before = len(printed_lines(run.text()))
    os.kill(server, signal.SIGKILL)
    assert run.wait(30) == 1, run.text()
    after = printed_lines(run.text())[before:]
    assert len(after) <= 6, "\n".join(after)
    [said] = [line for line in after if "the embedded etcd exited" in line]
    assert "killed by SIGKILL" in said and "cannot go on without it" in said
    log = re.search(r"its log is kept: (\S+)\)", said).group(1)
    assert Path(log).is_file(), "the message names a log that is gone"
    shutil.rmtree(Path(log).parent)  # the launcher's temporary etcd directory
    assert "Traceback" not in "\n".join(after)


def test_a_start_without_an_etcd_binary_leaves_no_empty_temporary_directory(
        tmp_path, monkeypatch):
    import elastic.launch.embedded_etcd as embedded

    def no_binary() -> str:
        raise FileNotFoundError("No etcd binary found (on purpose).")

    monkeypatch.setattr(embedded, "find_etcd_binary", no_binary)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(FileNotFoundError):
        embedded.EmbeddedEtcd().start()
    assert not list(tmp_path.glob("elastic-etcd-*"))
