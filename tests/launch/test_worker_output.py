"""The workers' output as the launcher prints it: whole lines with torchrun-like prefixes,
optional copies in files, a filter on local ranks, and no endless restarts of a script that
fails the same way before it ever joins or commits."""

from __future__ import annotations

import os
import re
import socket

import pytest

from tests.support.cli import WORKERS

pytestmark = pytest.mark.timeout(120)
CHATTY = str(WORKERS / "chatty.py")  # prints only, never joins: run with --plain
FAILS = str(WORKERS / "fails.py")
WORKER_LINE = re.compile(r"^\[(?:local|rank)(\d)\]: (\d)+$")  # --plain: [rankN], one node


def worker_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("[local", "[rank"))]


def test_lines_of_two_workers_carry_their_prefix_and_never_merge_mid_line(cli, etcd):
    run = cli("run", "--plain", "--etcd", etcd.url, "--job-id", f"chatty-{os.getpid()}", "-n", "2",
              CHATTY, "200")
    assert run.wait(60) == 0, run.text()[-2000:]
    lines = worker_lines(run.text())
    assert len(lines) == 400
    for line in lines:
        match = WORKER_LINE.match(line)
        assert match, line[:120]
        label, body = match.group(1), line.split(": ", 1)[1]
        assert body == label * 4000, f"a torn or merged line: {line[:60]}...{line[-60:]}"


def test_tee_writes_each_worker_to_its_own_file_and_the_filter_keeps_the_console_to_one(
        cli, etcd, tmp_path):
    log_dir = tmp_path / "logs"
    run = cli("run", "--plain", "--etcd", etcd.url, "--job-id", f"tee-{os.getpid()}", "-n", "2",
              "--log-dir", str(log_dir), "--tee", "3", "--local-ranks-filter", "1", CHATTY, "10")
    assert run.wait(60) == 0, run.text()[-2000:]
    assert {WORKER_LINE.match(line).group(1) for line in worker_lines(run.text())} == {"1"}
    host = socket.gethostname()
    for local_rank in (0, 1):
        copied = (log_dir / f"output-{host}-local{local_rank}.log").read_text().splitlines()
        assert copied == [str(local_rank) * 4000] * 10


def test_tee_without_a_log_dir_is_refused_in_one_line(cli):
    run = cli("run", "--tee", "3", CHATTY)
    assert run.wait(30) == 2
    lines = [line for line in run.text().splitlines() if line.strip()]
    assert len(lines) == 1 and "--tee needs --log-dir DIR" in lines[0], run.text()


# when, what the refusal says, the error, most lines printed (two tracebacks and ours)
REPEATS = [("import", "before it joined the job",
            "ValueError: the script failed before it joined (on purpose)", 25),
           ("first-step", "before its first commit",
            "ValueError: the script failed in its first step (on purpose)", 50)]


@pytest.mark.parametrize("when, stage, error, most_lines", REPEATS, ids=[r[0] for r in REPEATS])
def test_a_script_that_fails_the_same_way_before_its_first_commit_is_restarted_once_not_max(
        cli, etcd, when, stage, error, most_lines):
    run = cli("run", "--etcd", etcd.url, "--job-id", f"repeat-{when}-{os.getpid()}",
              "--max-restarts", "5", FAILS, "--when", when)
    assert run.wait(90) == 1, run.text()
    text = run.text()
    assert text.count("restarting worker") == 1, text
    assert text.count("Traceback") == 2, text
    [said] = [line for line in text.splitlines() if "failed the same way again" in line]
    assert f"failed the same way again {stage}" in said and "not restarting it" in said
    assert error in said
    assert len(text.splitlines()) <= most_lines, text


def test_a_torchrun_style_command_line_runs_with_one_note_per_flag_not_needed(cli):
    run = cli("run", "--plain", "--standalone", "--nnodes=1", "--nproc_per_node=2",
              "--max_restarts=0", CHATTY, "4")
    assert run.wait(60) == 0, run.text()[-2000:]
    text = run.text()
    assert {WORKER_LINE.match(line).group(1) for line in worker_lines(text)} == {"0", "1"}
    notes = [line for line in text.splitlines() if "is not needed here" in line]
    assert len(notes) == 2, text[-2000:]


def test_a_tee_file_that_cannot_be_written_costs_the_file_not_the_workers_output(
        cli, etcd, tmp_path):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a directory")
    run = cli("run", "--plain", "--etcd", etcd.url, "--job-id", f"badtee-{os.getpid()}", "-n", "1",
              "--log-dir", str(in_the_way / "logs"), "--tee", "3", CHATTY, "4000")
    assert run.wait(60) == 0, run.text()[-2000:]
    assert len(worker_lines(run.text())) == 4000, "the worker blocked or lost lines"
    assert sum("for --tee" in line for line in run.text().splitlines()) == 2  # stdout, stderr


@pytest.mark.unit
def test_a_traceback_that_torch_prefixed_with_its_rank_gets_one_prefix_only(capfd):
    import subprocess
    import sys

    from elastic.launch.output import OutputOptions, WorkerOutput

    script = ("import sys; sys.stderr.write('[rank0]: Traceback (most recent call last):\\n"
              "[rank0]: ValueError: boom\\n\\nplain [rank1]: inside\\n')")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    tail = WorkerOutput(OutputOptions(), "host").attach(proc, 1, "local1")
    assert proc.wait(timeout=30) == 0
    tail.join(30)
    assert capfd.readouterr().err.splitlines() == [
        "[local1]: Traceback (most recent call last):", "[local1]: ValueError: boom",
        "[local1]: ", "[local1]: plain [rank1]: inside"]
