"""Warm starts: workers forked from a template that imported torch once, sharing nothing else."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.launch.preload import parse_preload, script_imports
from tests.support.cli import WORKERS, events, wait_until
from tests.support.harness import loopback_env

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]
WORKER = str(WORKERS / "elastic_worker.py")
PROBE = str(WORKERS / "fork_probe.py")


def test_the_template_reads_a_scripts_top_level_imports_without_running_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os, torch\nfrom torch import nn\nfrom . import sibling\n"
                      "try:\n    import numpy as np\nexcept ImportError:\n    np = None\n"
                      "def f():\n    import json\nraise SystemExit('never run')\n")
    assert script_imports(str(script)) == ["os", "torch", "numpy"]
    assert script_imports(str(tmp_path / "missing.py")) == []


def test_preload_names_that_are_not_modules_are_refused_in_one_line():
    assert parse_preload("torch, transformers.models") == ("torch", "transformers.models")
    with pytest.raises(ValueError, match="not a module name"):
        parse_preload("torch,my-module")


def _fork_probes(count: int) -> tuple[int, list[dict]]:
    """Forks ``count`` probe workers in a host process (the warm start makes its caller a
    subreaper: never this test process); returns the template's pid and the reports."""
    host = subprocess.run([sys.executable, "-m", "tests.workers.fork_host", str(count), PROBE],
                          cwd=REPO, env=loopback_env(), capture_output=True, text=True,
                          timeout=200)
    assert host.returncode == 0, host.stderr
    lines = [json.loads(line) for line in host.stdout.splitlines()]
    reports = []
    for line in lines[1:]:
        assert line["exit"] == 0, host.stderr
        reports.append(json.loads(line["out"]))
    return lines[0]["template"], reports


def test_a_template_started_beside_a_folder_named_elastic_imports_the_launchers_package(
        tmp_path):
    """The launcher's cwd is the user's; a folder ``elastic`` there (this project's own
    checkout, say) must not stand in for the installed package in the template, and the worker
    still runs in that cwd with its script's folder first on its path and the relative entries
    of ``PYTHONPATH`` read against that cwd."""
    shadow = tmp_path / "elastic"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the folder in the cwd was imported')\n")
    (tmp_path / "src").mkdir()  # a relative PYTHONPATH entry, as the user's cwd reads it
    (tmp_path / "src" / "beside.py").write_text("FOUND = True\n")
    script = tmp_path / "job" / "probe.py"
    script.parent.mkdir()
    script.write_text("import json, os, sys\nimport elastic, beside\n"
                      "print(json.dumps({'elastic': elastic.__file__, 'cwd': os.getcwd(), "
                      "'path0': sys.path[0], 'beside': beside.FOUND}))\n")
    env = loopback_env()
    env["PYTHONPATH"] += os.pathsep + "src"
    host = subprocess.run([sys.executable, str(WORKERS / "fork_host.py"), "1", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert host.returncode == 0, host.stdout + host.stderr
    worker = json.loads(host.stdout.splitlines()[1])
    assert worker["exit"] == 0, host.stderr
    report = json.loads(worker["out"])
    assert not report["elastic"].startswith(str(tmp_path))
    assert report["cwd"] == str(tmp_path) and report["path0"] == str(script.parent)
    assert report["beside"] is True


def test_forked_workers_share_no_random_state_descriptors_threads_handlers_or_settings():
    template, (first, second) = _fork_probes(2)
    cold = json.loads(subprocess.run([sys.executable, PROBE], cwd=REPO, env=loopback_env(),
                                     capture_output=True, text=True, timeout=120,
                                     check=True).stdout)
    for report in (first, second):
        assert report["started_from"] == "template"
        assert report["template_threads"] == 1  # the template forks with one thread
        assert not report["cuda_initialised"]
        assert report["sid"] == report["pid"]  # its own session, like a cold worker
        assert report["fds"] == [0, 1, 2, 3]  # its streams (3: the listing's own)
        assert report["handlers"] == cold["handlers"]  # a fresh interpreter's
        assert report["mask"] == []
        assert report["orig_argv"][1:] == [PROBE]  # a restart in place runs the script
        # fsspec read FSSPEC_* at its import in the template: the worker's own count.
        assert report["fsspec_probe"] == {"marker": int(report["marker"])}
    for draw in ("random", "numpy", "torch", "torch_seed"):
        assert first[draw] != second[draw], draw  # seeded afresh, as two new processes are
    assert first["ppid"] == second["ppid"] != template  # adopted by the host, as by a launcher


def _replacement(log_dir: Path, before: set[int]) -> dict | None:
    return next((e for e in events(log_dir) if e["event"] == "joined"
                 and e["pid"] not in before), None)


def _trained(log_dir: Path, pid: int, since: float) -> bool:
    return any(e["event"] == "resumed" and e["pid"] == pid and e["t"] > since
               for e in events(log_dir))


def test_a_replacement_forked_from_the_template_reaches_its_first_step(cli, etcd, tmp_path):
    log_dir = tmp_path / "events"
    run = cli("run", "--etcd", etcd.url, "--job-id", f"warm-{os.getpid()}", "-n", "2",
              "--max-restarts", "1", "--log-dir", str(log_dir), WORKER, "--steps", "100000")
    wait_until(lambda: sum(e["event"] == "resumed" and e["world_size"] == 2
                           for e in events(log_dir)) >= 2, 150, "world 2", [run])
    first = {e["pid"]: e for e in events(log_dir) if e["event"] == "joined"}
    assert {e["started_from"] for e in first.values()} == {"template"}, run.text()
    killed_at = time.time()
    os.kill(min(first), signal.SIGKILL)
    wait_until(lambda: (r := _replacement(log_dir, set(first))) is not None
               and _trained(log_dir, r["pid"], killed_at), 60, "the replacement to train",
               [run])
    assert _replacement(log_dir, set(first))["started_from"] == "template"
    assert "warm start off" not in run.text()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(40) == 0, run.text()


def test_the_launcher_starts_workers_cold_in_one_line_once_the_template_died(cli, etcd,
                                                                             tmp_path):
    log_dir = tmp_path / "events"
    run = cli("run", "--etcd", etcd.url, "--job-id", f"cold-{os.getpid()}", "-n", "1",
              "--max-restarts", "2", "--log-dir", str(log_dir), WORKER, "--steps", "100000")
    wait_until(lambda: any(e["event"] == "resumed" for e in events(log_dir)), 150,
               "the first worker to train", [run])
    template = int(re.search(r"a template \(pid (\d+)\)", run.text())[1])
    os.kill(template, signal.SIGKILL)
    worker = next(e["pid"] for e in events(log_dir) if e["event"] == "joined")
    killed_at = time.time()
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: (r := _replacement(log_dir, {worker})) is not None
               and _trained(log_dir, r["pid"], killed_at), 120, "the cold replacement to train",
               [run])
    assert _replacement(log_dir, {worker})["started_from"] == "python"
    assert run.text().count("warm start off: the template is gone") == 1, run.text()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(40) == 0, run.text()
