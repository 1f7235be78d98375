"""Jobs through a real etcd with TLS (client certificates required) and authentication on.

A kill-and-add scenario runs end to end with each worker holding only its job's user; a worker
of job A started with job B's id (and A's credentials) is refused with a clear message; the
launcher and ``elastic status`` take the etcdctl-named flags and never show the password.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.scenarios.test_elastic_recovery import ARGS, check_outcome
from tests.support.cli import Cli, WORKERS, kill_everything
from tests.support.tls_etcd import JOB_A, JOB_B, JOB_USERS

PASSWORD = JOB_USERS[JOB_A][1]


def test_a_worker_is_killed_then_one_is_added_and_the_job_finishes_over_tls_with_auth(
        secure_job):
    job = secure_job(ARGS + ["--step-ms", "150"], {"FAULTS": "kill:2:12"}, job_id=JOB_A)
    job.start_together(range(3))
    assert job.wait_exit(2) == -signal.SIGKILL
    assert job.fired("kill", 2)["world"] == 3
    job.start(3)
    job.wait_until(lambda: any(p.get("world") == 3 and "loss" in p for p in job.progress(3)),
                   120, "the added worker to train in world 3")
    for index in (0, 1, 3):
        assert job.wait_exit(index) == 0
    check_outcome(job, [0, 1, 3])
    worlds = [p["world"] for p in job.progress(0) if "loss" in p]
    assert worlds[0] == 3 and 2 in worlds and worlds[-1] == 3


def test_a_worker_with_another_jobs_id_is_refused_naming_the_user_and_the_job_id(secure_job):
    job = secure_job(ARGS, job_id=JOB_B)  # alice's credentials, bob's job
    job.start(0)
    assert job.wait_exit(0, timeout=60) != 0
    log = (job.out / "worker-0.log").read_text()
    assert "EtcdAccessError: etcd user 'alice' may not" in log
    assert f"/elastic/{JOB_B}/" in log and "job id that this user is for" in log
    assert PASSWORD not in log


def run_cli(tmp_path: Path, name: str, *args: str, env: dict[str, str] | None = None) -> Cli:
    full_env = {"ELASTIC_ETCD_PASSWORD": "", **(env or {})}
    return Cli(list(args), tmp_path, name, full_env)


def test_status_with_a_wrong_password_file_says_so_in_one_line(secure_etcd, pki, tmp_path):
    wrong = tmp_path / "password"
    wrong.write_text("not-the-password\n")
    clis = [run_cli(tmp_path, "status", "status", "--etcd", secure_etcd.url, "--job-id", JOB_A,
                    "--etcd-cacert", str(pki.ca), "--etcd-cert", str(pki.client_cert),
                    "--etcd-key", str(pki.client_key), "--etcd-user", "alice",
                    "--etcd-password-file", str(wrong))]
    try:
        assert clis[0].wait(60) == 1
        lines = clis[0].text().strip().splitlines()
        assert len(lines) == 1, lines
        assert "refused user 'alice'" in lines[0] and "--etcd-password-file" in lines[0]
        assert "not-the-password" not in lines[0]
    finally:
        kill_everything(clis, [])


def test_a_launcher_with_flags_passes_them_to_its_workers_and_never_shows_the_password(
        secure_etcd, pki, tmp_path):
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    log_dir = tmp_path / "events"
    clis = [run_cli(tmp_path, "run", "run", "--etcd", secure_etcd.url, "--job-id", JOB_A,
                    "--etcd-cacert", str(pki.ca), "--etcd-cert", str(pki.client_cert),
                    "--etcd-key", str(pki.client_key), "--etcd-user", "alice",
                    "--etcd-password-file", str(secret), "--log-dir", str(log_dir),
                    str(WORKERS / "elastic_worker.py"), "--steps", "10")]
    try:
        assert clis[0].wait(90) == 0, clis[0].text()
        text = clis[0].text()
        assert "worker done at step 10" in text
        assert f"--etcd-user alice" in text and f"--etcd-cacert {pki.ca}" in text
        assert PASSWORD not in text and "ELASTIC_ETCD_PASSWORD=..." in text
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert PASSWORD.encode() not in cmdline
    finally:
        kill_everything(clis, [log_dir])


@pytest.mark.parametrize("problem", ["wrong CA", "wrong password"])
def test_elastic_run_refused_by_etcd_says_why_in_one_line_and_starts_no_worker(
        secure_etcd, pki, tmp_path, problem):
    password = tmp_path / "password"
    password.write_text(("not-the-password" if problem == "wrong password" else PASSWORD) + "\n")
    ca = pki.other_ca if problem == "wrong CA" else pki.ca
    clis = [run_cli(tmp_path, "run", "run", "--etcd", secure_etcd.url, "--job-id", JOB_A,
                    "--etcd-cacert", str(ca), "--etcd-cert", str(pki.client_cert),
                    "--etcd-key", str(pki.client_key), "--etcd-user", "alice",
                    "--etcd-password-file", str(password),
                    str(WORKERS / "elastic_worker.py"), "--steps", "10")]
    try:
        assert clis[0].wait(60) != 0
        lines = clis[0].text().strip().splitlines()
        assert len(lines) == 1, lines
        assert ("--etcd-cacert" if problem == "wrong CA" else "--etcd-password-file") in lines[0]
        assert "worker" not in lines[0] and "not-the-password" not in lines[0]
    finally:
        kill_everything(clis, [])
