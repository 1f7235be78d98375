"""`python -m benchmarks NAME` writes the result where the user's ``--out`` says, and to
``benchmarks/results/NAME.json`` only when none is given."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from benchmarks import __main__ as runner


@pytest.fixture
def bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A registered benchmark whose script writes ``{"steps": 3}`` to its ``--out``, with the
    results folder under ``tmp_path``."""
    script = tmp_path / "tiny_bench.py"
    script.write_text(textwrap.dedent("""
        import argparse, json
        parser = argparse.ArgumentParser()
        parser.add_argument("--out", required=True)
        open(parser.parse_args().out, "w").write(json.dumps({"steps": 3}))
    """))
    monkeypatch.setitem(runner.REGISTRY, "tiny", runner.Benchmark(
        str(script), (), "file", "a test's own"))
    monkeypatch.setattr(runner, "RESULTS", tmp_path / "results")
    return "tiny"


@pytest.mark.parametrize("form", ["--out PATH", "--out=PATH"])
def test_a_benchmark_given_out_writes_its_result_there_and_not_to_the_results_folder(
        bench, tmp_path, form):
    mine = tmp_path / "mine" / "run-1.json"
    assert runner.main([bench, *form.replace("PATH", str(mine)).split()]) == 0
    assert json.loads(mine.read_text()) == {"steps": 3}
    assert not (tmp_path / "results" / "tiny.json").exists()


def test_a_benchmark_without_out_writes_its_result_to_the_results_folder(bench, tmp_path):
    assert runner.main([bench]) == 0
    assert json.loads((tmp_path / "results" / "tiny.json").read_text()) == {"steps": 3}
