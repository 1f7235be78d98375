"""A newcomer's setup mistakes: one line saying what went wrong and what to do, nothing
trained, nothing restarted, and never a silent exit 0."""

from __future__ import annotations

import os

import pytest

from tests.support.cli import WORKERS, wait_until

pytestmark = pytest.mark.timeout(120)
NEWCOMER = str(WORKERS / "newcomer.py")
HOLDS_OPEN = str(WORKERS / "holds_open.py")


def elastic_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("elastic: ")]


def test_a_checkpoint_set_in_the_script_that_cannot_be_written_stops_before_the_first_step(
        cli, etcd, tmp_path):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a directory")
    run = cli("run", "--etcd", etcd.url, "--job-id", f"script-ckpt-{os.getpid()}",
              NEWCOMER, "--checkpoint", str(in_the_way / "run-7"))
    assert run.wait(90) == 1, run.text()
    text = run.text()
    assert "training started" not in text, text
    assert "Traceback" not in text, text
    assert "restarting worker" not in text, text
    [said] = [line for line in text.splitlines() if "is not writable" in line]
    assert "ElasticState(checkpoint=" in said, said


def test_a_checkpoint_set_in_the_script_with_an_unknown_scheme_stops_in_one_line(cli, etcd):
    # The store was opened in ElasticState's constructor, before the check that makes a
    # setup mistake one line: a traceback per worker, each restarted once, the --plain hint.
    run = cli("run", "--etcd", etcd.url, "--job-id", f"script-scheme-{os.getpid()}", "-n", "2",
              NEWCOMER, "--checkpoint", "foo://bucket/run-7")
    assert run.wait(90) == 1, run.text()
    text = run.text()
    assert "Traceback" not in text and "restarting worker" not in text, text
    said = [line for line in text.splitlines() if "'foo'" in line]
    assert said and all("ElasticState(checkpoint=" in line for line in said), text


def test_a_checkpoint_flag_that_contradicts_the_script_is_an_error_naming_both(
        cli, etcd, tmp_path):
    run = cli("run", "--etcd", etcd.url, "--job-id", f"two-ckpts-{os.getpid()}",
              "--checkpoint", str(tmp_path / "from-flag"),
              NEWCOMER, "--checkpoint", str(tmp_path / "from-script"))
    assert run.wait(90) == 1, run.text()
    text = run.text()
    assert "training started" not in text and "Traceback" not in text, text
    [said] = [line for line in text.splitlines() if "two checkpoint locations" in line]
    assert "from-flag" in said and "from-script" in said, said
    assert "--checkpoint" in said and "ElasticState(checkpoint=" in said, said


def test_a_script_that_never_calls_run_does_not_exit_0_and_says_so(cli, etcd):
    run = cli("run", "--etcd", etcd.url, "--job-id", f"no-run-{os.getpid()}",
              NEWCOMER, "--skip-run")
    assert run.wait(90) != 0, run.text()
    [said] = [line for line in elastic_lines(run.text()) if "never joined" in line]
    assert "ElasticState.run was not called" in said, said


@pytest.mark.parametrize("script, error", [("syntax_error.py", "SyntaxError"),
                                           ("missing_module.py", "ModuleNotFoundError")])
def test_a_script_that_cannot_be_imported_is_not_restarted_and_gets_one_specific_line(
        cli, etcd, script, error):
    run = cli("run", "--etcd", etcd.url, "--job-id", f"broken-{script[:6]}-{os.getpid()}",
              str(WORKERS / script))
    assert run.wait(90) == 1, run.text()
    text = run.text()
    assert "restarting worker" not in text and "--plain" not in text, text
    [said] = [line for line in elastic_lines(text) if error in line]
    assert "not restarting it" in said and "fix the script" in said, said


def test_a_checkpoint_from_elastic_checkpoint_is_checked_at_launch_like_the_flag(cli, tmp_path):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a directory")
    run = cli("run", NEWCOMER, env={"ELASTIC_CHECKPOINT": str(in_the_way / "run-7")})
    assert run.wait(90) == 1, run.text()
    assert "training started" not in run.text() and "Traceback" not in run.text(), run.text()
    [said] = [line for line in run.text().splitlines() if "is not writable" in line]
    assert "--checkpoint" in said, said


@pytest.mark.timeout(180)
def test_a_second_job_on_the_checkpoint_url_of_a_live_one_is_refused_and_starts_once_it_ended(
        cli, etcd, tmp_path):
    url, release = str(tmp_path / "ckpt"), tmp_path / "release"
    os.mkfifo(release)
    first_id, second_id = f"holder-{os.getpid()}", f"second-{os.getpid()}"
    first = cli("run", "--etcd", etcd.url, "--job-id", first_id, "--checkpoint", url,
                HOLDS_OPEN, "--release", str(release))
    wait_until(lambda: "holding" in first.text(), 60, "the first job to train", [first])
    refused = cli("run", "--etcd", etcd.url, "--job-id", second_id, "--checkpoint", url,
                  HOLDS_OPEN)
    assert refused.wait(60) == 1, refused.text()
    [said] = elastic_lines(refused.text())
    assert f"in use by job {first_id!r}" in said and url in said, said
    assert "holding" not in refused.text(), refused.text()
    wait_until(lambda: _opened_for_writing(release), 30, "the first job's release", [first])
    assert first.wait(60) == 0, first.text()
    second = cli("run", "--etcd", etcd.url, "--job-id", second_id, "--checkpoint", url,
                 HOLDS_OPEN)  # its claim comes before "started job": that line is the proof
    wait_until(lambda: f"started job {second_id}" in second.text(), 60, "the second job",
               [second])


def _opened_for_writing(fifo) -> bool:
    """Opens ``fifo`` for writing once its reader is there (then closes it: the release)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: no reader yet
        return False
    return True
