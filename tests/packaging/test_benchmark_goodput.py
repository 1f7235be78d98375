"""The goodput benchmark counts only work that was kept, weighs it by the world that did it, and
fires its faults on its stated schedule; torchft stays an optional benchmark extra."""

from __future__ import annotations

import random
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import goodput  # noqa: E402
import soak  # noqa: E402

pytestmark = pytest.mark.unit


def progress(t: float, step: int, world: int = 4) -> dict:
    return {"t": t, "event": "progress", "step": step, "world_size": world}


def test_a_commit_that_was_rolled_back_is_not_counted_as_useful():
    # Rank 0 committed step 12 and died; the survivors went on from step 8 and re-did 9..12.
    events = [progress(1, 4), progress(2, 8), progress(3, 12), progress(5, 8, 3),
              progress(6, 12, 3), progress(7, 16, 3)]
    line = goodput.kept_line(events)
    assert [e["step"] for e in line] == [4, 8, 8, 12, 16]
    assert goodput.useful_at(line, 4.0)[0] == 8  # the lost commit of t=3 never counts
    assert goodput.useful_at(line, 7.0)[0] == 16


def test_each_useful_step_is_weighed_by_the_world_that_took_it():
    line = goodput.kept_line([progress(1, 4, 4), progress(2, 8, 4), progress(3, 12, 3)])
    assert goodput.useful_at(line, 3.0) == (12, 4 * 4 + 4 * 4 + 4 * 3)


def test_the_schedule_puts_one_fault_in_the_middle_half_of_each_interval():
    offsets = goodput.schedule(random.Random(1), 60, 1800)
    assert len(offsets) == 30
    for i, offset in enumerate(offsets):
        assert 60 * (i + 0.25) <= offset < 60 * (i + 0.75)


def test_a_world_short_of_workers_gets_a_join_and_a_full_one_a_worker_fault():
    rng = random.Random(3)
    assert goodput.choose(rng, live=3, workers=4) == "join"
    kinds = {goodput.choose(rng, live=4, workers=4) for _ in range(200)}
    assert kinds == set(goodput.WORKER_FAULTS)


def test_a_worker_fault_never_hits_a_worker_still_starting(tmp_path):
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "events-a.jsonl").write_text(
        '{"t": 1.0, "event": "joined", "pid": 12}\n{"t": 2.0, "event": "resumed", "pid": 11}\n')
    started, starting = SimpleNamespace(pid=11), SimpleNamespace(pid=12)
    job = SimpleNamespace(root=tmp_path, live=[started, starting])
    assert goodput.trained(job) == [started]


def test_a_fault_interval_longer_than_the_run_is_refused_with_the_fix(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["soak.py", "--fault-every", "100", "--duration", "50"])
    with pytest.raises(SystemExit) as exited:
        soak.main()
    assert exited.value.code == 2
    assert "pick a shorter interval or a longer --duration" in capsys.readouterr().err


def test_torchft_is_an_optional_benchmark_extra_and_never_a_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("torchft")]
    extras = project["optional-dependencies"]
    assert not [d for d in extras["test"] if d.startswith("torchft")]
    assert "torchft==0.2.0" in extras["bench-torchft"]


def test_goodput_counts_only_the_workers_present_a_joiner_from_when_it_asks_to_join():
    faults = [{"kind": "kill", "t": 10.0}, {"kind": "join", "t": 20.0, "pid": 7},
              {"kind": "stop", "t": 30.0, "woken": 35.0}, {"kind": "replace", "t": 40.0},
              {"kind": "join", "t": 45.0, "pid": 8}]  # pid 8 never asked to join
    changes = goodput.slot_changes(faults, {7: 24.0})
    assert goodput.slot_time(changes, 4, 0.0, 50.0) == {"4": 10 + 6 + 15, "3": 14 + 5}
    assert goodput.slot_time(changes, 4, 10.0, 20.0) == {"3": 10}  # the kill's stretch
    assert goodput.slot_time(changes, 4, 40.0, 45.0) == {"4": 5}  # a replaced worker's slot


def test_fewer_workers_are_expected_to_train_at_their_own_steady_rate_scaled_to_the_reference():
    turn = {"workers": 4, "reference_samples": 2000.0,
            "steady_samples_per_s": {"4": 1900.0, "3": 1520.0}}
    assert goodput.expected(turn, {"4": 10.0, "3": 5.0}) == 2000 * 10 + 2000 * 0.8 * 5
    turn["steady_samples_per_s"] = {"4": 1900.0}  # never 3 steadily: in proportion
    assert goodput.expected(turn, {"3": 4.0}) == 2000 * 0.75 * 4


def test_a_worlds_steady_rate_leaves_out_each_fault_until_a_second_after_its_recovery():
    line = [progress(0, 0), progress(1, 10), progress(2, 20), progress(3, 25, 3),
            progress(4, 35, 3), progress(5, 45, 3)]
    faults = [{"t": 2.5, "recovery_s": 0.4, "end": 9.0}]  # steady from 3.9 s on
    rates = goodput.steady_rates(line, faults)
    assert rates == {"4": 10 * 4 * goodput.BATCH, "3": 10 * 3 * goodput.BATCH}
