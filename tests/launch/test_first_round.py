"""``elastic run -n N`` on one node forms its first round with all N local workers, however
far apart they reach ``state.run()`` (within the ``local_start`` timeout)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import WORKERS, events

pytestmark = pytest.mark.timeout(300)
NEWCOMER = str(WORKERS / "newcomer.py")


def first_world(log_dir: Path) -> int:
    [size] = {e["world_size"] for e in events(log_dir)
              if e["event"] == "round_formed" and e["round"] == 1}
    return size


def test_a_worker_that_imports_slowly_is_in_the_first_round(cli, tmp_path):
    log_dir = tmp_path / "events"
    run = cli("run", "-n", "2", "--log-dir", str(log_dir), NEWCOMER, "--late-s", "3")
    assert run.wait(120) == 0, run.text()
    assert first_world(log_dir) == 2, run.text()


def test_two_local_workers_form_the_first_round_together_three_runs_in_a_row(cli, tmp_path):
    # Workers that start together, however they race; the test above makes one seconds late.
    for attempt in range(3):
        log_dir = tmp_path / f"events-{attempt}"
        run = cli("run", "-n", "2", "--log-dir", str(log_dir), NEWCOMER)
        assert run.wait(120) == 0, run.text()
        assert first_world(log_dir) == 2, f"run {attempt}: {run.text()}"
