"""torchrun's spellings: accepted where they mean the same, answered in one line where not."""

from __future__ import annotations

import pytest

from elastic.launch.cli import _VALUE_OPTIONS, main
from elastic.launch.torchrun_flags import INSTEAD, NOT_NEEDED, TorchrunFlagError, translate

pytestmark = pytest.mark.unit


def test_underscore_spellings_of_our_flags_become_ours_and_the_script_args_are_untouched():
    argv = ["--nproc_per_node=2", "--max_restarts", "1", "--local_ranks_filter", "0",
            "--log_dir", "/tmp/x", "train.py", "--my_flag", "--nnodes", "4"]
    assert translate(argv, _VALUE_OPTIONS) == [
        "--nproc-per-node=2", "--max-restarts", "1", "--local-ranks-filter", "0",
        "--log-dir", "/tmp/x", "train.py", "--my_flag", "--nnodes", "4"]


def test_rdzv_id_is_the_job_id():
    assert translate(["--rdzv_id", "run7", "-m", "pkg"], _VALUE_OPTIONS) == [
        "--job-id", "run7", "-m", "pkg"]


@pytest.mark.parametrize("flags, note", [
    (["--standalone"], "--standalone is not needed here: without --etcd"),
    (["--nnodes=1"], "--nnodes 1 is not needed here"),
    (["--rdzv_backend", "c10d"], "--rdzv-backend is not needed here: the rendezvous is always"),
    (["--master_port", "29500"], "--master-port is not needed here"),
    (["--node_rank=0"], "--node-rank is not needed here"),
])
def test_torchrun_only_flags_that_are_not_needed_are_dropped_with_one_line_saying_why(
        capsys, flags, note):
    assert translate([*flags, "train.py"], _VALUE_OPTIONS) == ["train.py"]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and note in lines[0] and lines[0].endswith("(ignored).")


@pytest.mark.parametrize("flags, answer", [
    (["--rdzv-endpoint", "host:2379"], "use --etcd http://HOST:PORT"),
    (["--rdzv_endpoint=host:2379"], "use --etcd http://HOST:PORT"),
    (["--nnodes", "1:4"], "--min-workers/--max-workers"),
])
def test_torchrun_flags_with_another_meaning_say_what_to_use_instead(flags, answer):
    with pytest.raises(TorchrunFlagError, match="is torchrun's; here") as caught:
        translate([*flags, "train.py"], _VALUE_OPTIONS)
    assert answer in str(caught.value)


def test_the_command_line_answers_a_torchrun_flag_in_one_line_and_exits_two(capsys):
    assert main(["run", "--rdzv-endpoint", "h:1", "train.py"]) == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(lines) == 1 and "--etcd http://HOST:PORT" in lines[0]


def test_version_names_the_package_and_python_without_importing_torch(capsys):
    import sys
    had_torch = "torch" in sys.modules
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("elastic-trainer ") and "Python 3." in out
    assert had_torch or "torch" not in sys.modules


def test_run_help_lists_the_defaults_and_the_torchrun_spellings(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["run", "--help"])
    assert ended.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for default in ("fewest workers to train with, all nodes together (default 1)",
                    "extra ones wait as spares (default: no limit)", "default 3)",
                    "nccl on GPUs, gloo on CPU (default auto", "(ELASTIC_METRICS_PORT"):
        assert default in shown, default
    assert "--nproc_per_node (and the underscore spelling of every flag above)" in shown
    for flag in (*NOT_NEEDED, *INSTEAD):
        assert flag in shown, flag


def test_a_launcher_warning_reads_like_its_other_lines_without_a_timestamp():
    import os
    import subprocess
    import sys

    script = ("import logging; from elastic.launch.cli import main; main(['--version']); "
              "logging.getLogger('elastic.launch.x').warning('could not write %s', 'it')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items()
                                           if k != "ELASTIC_LOG_LEVEL"})
    assert done.stderr.splitlines() == ["elastic: could not write it"], done.stderr
