"""Runs that do nothing say so and exit non-zero: a finished job resumed again, a job whose
checkpoint location cannot be written (and Ctrl-C exits 130: see test_run.py)."""

from __future__ import annotations

import os

import pytest

from tests.support.cli import WORKERS

pytestmark = pytest.mark.timeout(150)
EPOCHS = str(WORKERS / "epochs.py")


def run_epochs(cli, etcd, name: str, checkpoint: str, *flags: str):
    run = cli("run", "--etcd", etcd.url, "--job-id", f"{name}-{os.getpid()}", *flags, EPOCHS,
              "--checkpoint", checkpoint, name=name)
    run.wait(90)
    return run


def test_running_a_finished_job_again_trains_nothing_and_exits_non_zero_saying_why(
        cli, etcd, tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    first = run_epochs(cli, etcd, "first", checkpoint)
    assert first.proc.returncode == 0, first.text()
    again = run_epochs(cli, etcd, "again", checkpoint)
    assert again.proc.returncode == 1, again.text()
    text = again.text()
    assert "NothingTrainedError: the job resumed its checkpoint" in text
    assert "pass --resume-finished" in text
    assert text.count("Traceback") == 1, "the worker of a finished job is not restarted"
    assert "failed after the job had finished" in text and "restarting worker" not in text
    assert len(text.splitlines()) <= 25, text


def test_resume_finished_lets_a_finished_job_resume_and_exit_zero(cli, etcd, tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    assert run_epochs(cli, etcd, "first", checkpoint).proc.returncode == 0
    again = run_epochs(cli, etcd, "again", checkpoint, "--resume-finished")
    assert again.proc.returncode == 0, again.text()
    assert "worker done at epoch 2" in again.text()


def test_a_job_whose_checkpoint_location_cannot_be_written_stops_before_training_naming_it(
        cli, etcd, tmp_path):
    # The worker's own checkpoint (epochs.py --checkpoint) is probed before its first step, so
    # an unwritable location never costs a whole run of failed durable commits.
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a directory")
    run = run_epochs(cli, etcd, "unwritable", str(in_the_way / "ckpt"))
    assert run.proc.returncode == 1, run.text()
    assert f"{in_the_way / 'ckpt'}" in run.text() and "is not writable" in run.text(), run.text()
    assert "worker done" not in run.text() and "restarting worker" not in run.text()
