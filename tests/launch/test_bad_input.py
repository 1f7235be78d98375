"""Bad input gets one clear line that says what to do, a non-zero exit, and no traceback."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import tempfile
from datetime import timedelta

import pytest

from elastic.launch.cli import main
from elastic.cluster.links.ports import free_port
from elastic.cluster.etcd.client import EtcdClient
from elastic.launch.job_config import JobConfig, claim
from elastic.launch.parent_death import OWNER
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.membership import EtcdMembership
from tests.support.cli import WORKERS
from tests.support.polling import poll_until
from elastic.foundation.timeouts import Timeouts

pytestmark = pytest.mark.timeout(60)
WORKER = str(WORKERS / "elastic_worker.py")


def one_clear_line(text: str, *needles: str) -> None:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{text}"
    assert "Traceback" not in text
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


@pytest.mark.parametrize("args, needles", [
    (["run", "--bogus", WORKER], ["unrecognized arguments: --bogus", "--help"]),
    (["run", "missing_script.py"], ["'missing_script.py' not found"]),
    (["run", "-n", "0", WORKER], ["--nproc-per-node (0) must be at least 1"]),
    (["run", "--min-workers", "3", "--max-workers", "2", WORKER],
     ["--max-workers (2) must be >= --min-workers (3)"]),
    (["run", "--etcd", "nonsense", WORKER], ["needs a host and a port"]),
    (["status", "--etcd", "http://127.0.0.1:99999", "--job-id", "x"],
     ["etcd URL 'http://127.0.0.1:99999' has a port outside 1-65535"]),
    (["run"], ["no script given"]),
    (["frobnicate"], ["unknown command 'frobnicate'"]),
    (["status", "--job-id", "x"], ["--etcd"]),
    (["run", "--log-dir", "/proc/no-such-dir/logs", WORKER],
     ["--log-dir /proc/no-such-dir/logs cannot be written"]),
    (["report", "/proc/no-such-dir", "--out", "r.txt"], ["--out r.txt must name a .png file"]),
    (["run", "--lease-ttl", "-1", WORKER],
     ["argument --lease-ttl: must be a positive number of seconds, e.g. 3 (got '-1')"]),
    (["run", "--settle", "soon", WORKER], ["argument --settle", "(got 'soon')"]),
    (["run", "--form-timeout", "0", WORKER], ["argument --form-timeout", "positive"]),
    (["run", "--collective-timeout", "nan", WORKER], ["argument --collective-timeout"]),
    (["run", "--rendezvous-timeout", "inf", WORKER], ["argument --rendezvous-timeout"]),
    (["run", "--grace=-5", WORKER], ["argument --grace", "(got '-5')"]),
    (["run", "--lease-ttl", "0.5", WORKER], ["--lease-ttl (0.5 s) must be at least 1 s"]),
    (["run", "--node-lease", "--plain", WORKER],
     ["--node-lease works with elastic workers only"]),
    (["run", "--settle", "400", WORKER],
     ["--settle (400 s) must be shorter than", "--rendezvous-timeout (300 s)",
      "lower ELASTIC_SETTLE or raise ELASTIC_RENDEZVOUS_TIMEOUT"]),
    (["run", "--form-timeout", "30", "--collective-timeout", "20", WORKER],
     ["--form-timeout (30 s) must be shorter than", "--collective-timeout (20 s)"]),
    (["run", "--job-id", "../other", WORKER], ["job id '../other' must start with a letter"]),
    (["run", "--job-id", "a/b", "--etcd", "http://127.0.0.1:2379", WORKER],
     ["'a/b'", "letters, digits"]),
    (["run", "--job-id", "j" * 65, WORKER], ["65 characters long; use at most 64"]),
    (["status", "--etcd", "http://127.0.0.1:2379", "--job-id", "x y"], ["job id 'x y'"]),
    (["run", "--etcd-cacert", "/no/such/ca.pem", "--etcd", "https://127.0.0.1:2379", WORKER],
     ["--etcd-cacert / ELASTIC_ETCD_CACERT (/no/such/ca.pem) is not a readable file"]),
    (["run", "--etcd-user", "alice", "--etcd", "https://127.0.0.1:2379", WORKER],
     ["etcd user 'alice' needs a password", "--etcd-password-file"]),
    (["run", "--etcd-user", "alice", "--etcd-password-file", "/no/such/file", WORKER],
     ["--etcd-password-file /no/such/file: cannot read it"]),
    (["status", "--etcd", "https://127.0.0.1:2379,http://127.0.0.1:2380", "--job-id", "x"],
     ["mix http:// and https://"]),
])
def test_bad_command_lines_get_one_line_and_exit_two(capsys, monkeypatch, args, needles):
    for name in ("ELASTIC_ETCD_USER", "ELASTIC_ETCD_PASSWORD", "ELASTIC_ETCD_CACERT"):
        monkeypatch.delenv(name, raising=False)
    # In process (argument checks start nothing); the subprocess path is tested below.
    assert main(args) == 2
    captured = capsys.readouterr()
    one_clear_line(captured.out + captured.err, *needles)


def test_a_bad_etcd_url_is_refused_before_a_killed_launchers_leftovers_are_swept(
        capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    leftover = tmp_path / "elastic-etcd-of-a-killed-launcher"
    leftover.mkdir()
    (leftover / OWNER).write_text("999999999 1\n")  # no such process
    assert main(["run", "--etcd", "nonsense", WORKER]) == 2
    captured = capsys.readouterr()
    one_clear_line(captured.out + captured.err, "etcd URL 'nonsense' needs a host and a port")
    assert leftover.exists(), "a refused command line swept the leftovers"


def test_a_malformed_timeout_variable_gets_one_line_naming_it(capsys, monkeypatch):
    monkeypatch.setenv("ELASTIC_FORM_TIMEOUT", "soon")
    assert main(["run", WORKER]) == 2
    captured = capsys.readouterr()
    one_clear_line(captured.out + captured.err, "ELASTIC_FORM_TIMEOUT='soon' must be a number "
                   "of seconds, e.g. ELASTIC_FORM_TIMEOUT=20.")


def test_the_console_entry_point_rejects_an_unknown_flag_in_one_line(cli):
    run = cli("run", "--bogus", WORKER)
    assert run.wait(30) == 2
    one_clear_line(run.text(), "unrecognized arguments: --bogus")


def test_an_unreachable_etcd_fails_after_bounded_retries_naming_the_url(cli):
    url = f"http://127.0.0.1:{free_port()}"
    run = cli("run", "--etcd", url, WORKER)
    assert run.wait(45) == 1  # a hang guard: unbounded retries never exit
    one_clear_line(run.text(), url, "Check that etcd runs")


def test_a_job_running_with_another_configuration_is_refused(cli, etcd):
    job = f"conflict-{os.getpid()}"
    keys = JobKeys(job)
    client = EtcdClient(etcd.url)
    launcher = EtcdMembership(client, keys.launchers(), "127.0.0.1",
                              Timeouts.from_env({}, lease_ttl=timedelta(seconds=10)))
    try:
        claim(client, keys, JobConfig(mode="elastic", target="elastic_worker.py", min_workers=1,
                                      max_workers=None, checkpoint=None, backend="auto"))
        launcher.register()  # a live launcher of the job
        run = cli("run", "--etcd", etcd.url, "--job-id", job, "--min-workers", "2", WORKER)
        assert run.wait(30) == 1
        one_clear_line(run.text(), "already running with another configuration",
                       "min_workers: 1 (running) != 2 (yours)", "--job-id")
    finally:
        launcher.leave()
        client.close()


def test_report_writes_a_png_and_prints_the_recoveries(cli, tmp_path):
    log_dir = tmp_path / "events"
    log_dir.mkdir()
    t = 1_700_000_000.0
    rows = [(0.0, "joined", {}), (0.1, "joined", {}), (0.2, "joined", {}),
            (0.5, "resumed", {"round": 1, "world_size": 3, "reason": "start", "version": 1}),
            (5.0, "failure_detected", {"round": 1}), (5.1, "failure_detected", {"round": 1,
                                                                                 "worker": "v"}),
            (5.3, "resumed", {"round": 2, "world_size": 3, "reason": "start", "version": 9,
                              "worker": "restarted"}),
            (5.4, "resumed", {"round": 2, "world_size": 3, "reason": "failure", "version": 9}),
            (8.9, "membership_changed", {"round": 2, "rank": 0, "version": 20}),
            (9.0, "resumed", {"round": 3, "world_size": 3, "reason": "change", "version": 20}),
            (9.5, "checkpoint_written", {"version": 24, "url": "file:///ck/000000000024",
                                         "blocked_s": 0.004, "write_s": 0.25}),
            (9.9, "checkpoint_failed", {"version": 28, "error": "storage gone"})]
    rows += [(0.5 + i * 0.25, "progress", {"step": i * 2}) for i in range(40)]
    with open(log_dir / "events-w.jsonl", "w") as out:
        for dt, event, fields in rows:
            out.write(json.dumps({"t": t + dt, "event": event, "worker": "w", **fields}) + "\n")
    png = tmp_path / "timeline.png"
    run = cli("report", str(log_dir), "--out", str(png))
    assert run.wait(60) == 0, run.text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "0.40 s (failure detected -> resumed in world 3)" in run.text()
    assert "world changes agreed at a commit: 1" in run.text()
    assert re.search(r"2\s+5\.30\s+3\s+failure \+1 new\s+9\s+0\.40", run.text()), run.text()
    assert "failures: 1\n  failure at 5.00 s: detected by 2 peers" in run.text()
    assert "written          24        0.004      0.250  file:///ck/000000000024" in run.text()
    assert "failed           28" in run.text() and "storage gone" in run.text()


def test_report_to_an_unwritable_png_names_the_flag_in_one_line(tmp_path, capsys):
    (tmp_path / "events-w.jsonl").write_text(json.dumps(
        {"t": 1.0, "event": "resumed", "worker": "w", "round": 1, "world_size": 1,
         "reason": "start", "version": 1}) + "\n")
    assert main(["report", str(tmp_path), "--out", "/proc/no-such-dir/r.png"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "give --out a path" in err, err


def test_report_on_a_directory_without_events_says_what_to_pass(cli, tmp_path):
    run = cli("report", str(tmp_path / "nothing"))
    assert run.wait(30) == 1
    one_clear_line(run.text(), "--log-dir")


def test_elastic_etcd_suggests_a_fresh_job_id_each_time_never_a_shared_one(cli, tmp_path):
    suggested = []
    for name in ("first", "second"):
        run = cli("etcd", "--data-dir", str(tmp_path / name), name=name)
        assert poll_until(lambda: "--job-id" in run.text(), 30), run.text()
        run.proc.send_signal(signal.SIGINT)
        assert run.wait(30) == 0, run.text()
        suggested.append(re.search(r"--job-id (\S+)", run.text()).group(1))
    assert suggested[0] != suggested[1] and "myjob" not in suggested
    assert all(re.fullmatch(r"job-\d{8}-\d{6}-[0-9a-f]{4}", job) for job in suggested), suggested


def test_ctrl_c_in_a_command_is_one_line_and_the_shells_status_for_sigint(monkeypatch, capsys):
    # Ctrl-C before the launcher's own handler was installed (etcd starting, a connect retry,
    # `elastic status`) printed a KeyboardInterrupt traceback of up to 30 lines.
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(__import__("elastic.launch.cli", fromlist=["COMMANDS"]).COMMANDS,
                        "status", interrupted)
    assert main(["status", "--etcd", "http://127.0.0.1:2379", "--job-id", "x"]) == 130
    one_clear_line(capsys.readouterr().err, "elastic: interrupted")


def test_ctrl_c_while_the_embedded_etcd_starts_leaves_no_server_and_no_directory(monkeypatch):
    from elastic.launch.embedded_etcd import EmbeddedEtcd

    spawned = []

    def interrupted(self):
        spawned.append(self.process)
        raise KeyboardInterrupt

    monkeypatch.setattr(EmbeddedEtcd, "_wait_healthy", interrupted)
    server = EmbeddedEtcd()
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert spawned[0].poll() is not None
    assert not os.path.exists(server.data_dir)


def test_an_etcd_url_that_serves_grpc_but_not_etcd_is_one_line(capsys):
    # Any gRPC server answers etcd's calls with UNIMPLEMENTED: a 70-line traceback ending in
    # aetcd's ClientError('Method not found!').
    import grpc
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code = main(["status", "--etcd", f"http://127.0.0.1:{port}", "--job-id", "x"])
    finally:
        server.stop(None)
    assert code == 1
    one_clear_line(capsys.readouterr().err, "not an etcd v3 client URL")



def test_a_setting_that_differs_from_the_running_jobs_reads_as_a_user_would_write_it():
    running = JobConfig(mode="elastic", target="train.py", min_workers=1, max_workers=None,
                        checkpoint=None, backend="auto")
    mine = dataclasses.replace(running, checkpoint="/ck/run-7")
    assert mine.differences(running) == ["checkpoint: none (running) != '/ck/run-7' (yours)"]
