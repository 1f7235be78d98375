"""What the launcher's metrics take from its workers' event files (no server, no processes)."""

from __future__ import annotations

import json

import pytest

from elastic.launch.metrics import WorkerEvents

pytestmark = pytest.mark.unit


def resumed(t: float, rnd: int, reason: str, world: int, recovery_s: float = 0.1) -> dict:
    return {"t": t, "event": "resumed", "round": rnd, "reason": reason, "world_size": world,
            "recovery_s": recovery_s}


def test_a_round_counts_once_per_reason_whichever_local_worker_tells_it(tmp_path):
    survivor, newcomer = tmp_path / "events-h-1.jsonl", tmp_path / "events-h-2.jsonl"
    survivor.write_text("".join(json.dumps(e) + "\n" for e in [
        resumed(1.0, 1, "start", 2), resumed(2.0, 2, "failure", 1, 0.09),
        resumed(3.0, 3, "change", 2, 0.04)]) + '{"t": 4.0, "event": "progr')  # torn: skipped
    newcomer.write_text(json.dumps(resumed(3.1, 3, "start", 2)) + "\n")
    seen = WorkerEvents()
    seen.read([newcomer, survivor])
    seen.read([newcomer, survivor])  # nothing new: nothing counted twice
    assert dict(seen.reformations) == {"start": 2, "failure": 1, "change": 1}
    assert seen.recovery.counts[0] == 1 and sum(seen.recovery.counts) == 2  # 0.04 <= 0.05
    assert seen.world == (3.1, 2) and seen.round == 3
    with open(survivor, "a") as f:
        f.write('ess", "step": 40}\n')
    seen.read([survivor])
    assert seen.step == 40
