"""One import namespace: a user's own state.py or checkpoint.py next to the training script
cannot shadow ours, and the CLI's help imports neither torch nor the etcd client."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.harness import loopback_env

SHADOWS = {
    "state.py": "raise ImportError('the user state.py was imported by elastic')\n",
    "checkpoint.py": "raise ImportError('the user checkpoint.py was imported by elastic')\n",
}


def _write_shadowing_files(folder: Path) -> None:
    for name, text in SHADOWS.items():
        (folder / name).write_text(text)


def test_the_public_api_imports_next_to_a_users_state_and_checkpoint_modules(tmp_path):
    _write_shadowing_files(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        from elastic import (CheckpointError, CheckpointStore, ElasticSampler, ElasticState,
                             PeerFailureError, TrainState)
        print("imported")
    """))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"


@pytest.mark.timeout(240)
def test_a_job_runs_under_elastic_run_beside_a_users_state_and_checkpoint_modules(etcd, tmp_path):
    _write_shadowing_files(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        import torch
        from elastic import CheckpointStore, ElasticState

        def train(state):
            while state.step < 3:
                state.model.weight.data += 1
                state.step += 1
                state.commit(durable=True)
            return {"step": state.step, "rank": state.rank}

        state = ElasticState(model=torch.nn.Linear(2, 1, bias=False), step=0)
        print(json.dumps(state.run(train)))
    """))
    ckpt = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, "-m", "elastic", "run", "--etcd", etcd.url, "--job-id",
         f"shadow-{tmp_path.name}", "-n", "2", "--min-workers", "2", "--checkpoint", str(ckpt),
         str(script)],
        cwd=tmp_path, env=loopback_env(), capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line[line.index("{"):]) for line in done.stdout.splitlines()
               if '"step"' in line]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["step"] == 3 for r in results)
    assert any(p.name == "manifest.json" for p in ckpt.rglob("*"))


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"], ["run", "--help"]])
def test_the_cli_help_imports_neither_torch_nor_the_etcd_client(argv):
    probe = textwrap.dedent(f"""
        import sys
        from elastic.launch.cli import main
        try:
            main({argv!r})
        except SystemExit:
            pass
        heavy = sorted(m for m in ("torch", "aetcd", "grpc", "numpy") if m in sys.modules)
        print("HEAVY", ",".join(heavy))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "HEAVY"
