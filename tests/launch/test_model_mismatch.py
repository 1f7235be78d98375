"""A worker of ``elastic run`` whose sharded model differs from the others' stops in one line,
the launcher does not restart it, and the others train the job to its end."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.cli import WORKERS

pytestmark = pytest.mark.timeout(240)
SHARDED = str(WORKERS / "sharded.py")


def test_a_worker_whose_model_differs_stops_in_one_line_and_is_not_restarted(cli, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = cli("run", "-n", "3", "--max-restarts", "3", SHARDED, "--out", str(out),
              "--epochs", "2", "--samples", "96", "--global-batch", "8",
              env={"TEST_NET_WIDTH_AT": "2:14"})
    code = run.wait(200)
    text = run.text()
    errors = [line for line in text.splitlines() if "built another model" in line]
    assert len(errors) == 1 and "model/blocks.1." in errors[0], text[-3000:]
    assert re.search(r"local_rank=2 .*stopped on a mistake in its setup", text), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for index in (0, 1):  # the two alike trained the whole job
        assert json.loads((out / f"result-{index}.json").read_text())["step"] == 24
    assert not (out / "result-2.json").exists()
    assert code == 1, text[-3000:]  # one worker failed, and was not restarted
