"""`elastic status` for a person: one table of members, a readable checkpoint line."""

from __future__ import annotations

import pytest

from elastic.launch.status import render

pytestmark = pytest.mark.unit
STATUS = {
    "job_id": "run7", "finished": False, "round": 4,
    "config": {"mode": "elastic", "target": "train.py", "max_workers": None},
    "launchers": [{"member": "l1", "host": "vm", "pid": 10, "addr": "127.0.0.1"}],
    "members": [{"member": "vm-11-aa", "host": "vm", "pid": 11, "addr": "127.0.0.1"},
                {"member": "vm-12-bb", "host": "vm", "pid": 12, "addr": "127.0.0.1"},
                {"member": "vm-13-cc", "host": "vm", "pid": 13, "addr": "127.0.0.1"}],
    "plan": {"world_size": 2, "ranks": ["vm-12-bb", "vm-11-aa"], "spares": [],
             "master": "127.0.0.1:5000", "versions": {"vm-12-bb": 40, "vm-11-aa": 35}},
    "commit": {"version": 40, "url": "file:///tmp/ckpt/000000000040", "epoch": 2,
               "t": 1_000_000.0, "member": "vm-12-bb"},
}


def test_status_is_a_table_with_one_row_per_member_by_rank_and_a_readable_checkpoint():
    lines = render(STATUS, now=1_000_035.0).splitlines()
    assert lines[0] == "job run7: round 4, world size 2, master 127.0.0.1:5000"
    assert lines[1] == "config: mode=elastic, target=train.py"
    header, *rows = lines[2:6]
    assert header.split() == ["RANK", "MEMBER", "HOST", "PID", "ADDRESS", "VERSION", "AT", "JOIN"]
    assert [row.split()[:2] for row in rows[:3]] == [["0", "vm-12-bb"], ["1", "vm-11-aa"],
                                                    ["-", "vm-13-cc"]]
    assert len({row.index("vm-") for row in rows[:3]}) == 1, "columns line up"
    assert lines[-2] == "launchers: vm pid 10 (127.0.0.1)"
    assert lines[-1].startswith("last durable checkpoint: version 40 (epoch 2) at "
                                "file:///tmp/ckpt/000000000040, written ")
    assert lines[-1].endswith("(35 s ago)") and "{" not in lines[-1]


def test_status_of_an_ended_job_says_an_embedded_etcd_ends_with_its_job(capsys, monkeypatch):
    from elastic.cluster.links.ports import free_port
    from elastic.launch.cli import main

    monkeypatch.setenv("ELASTIC_CONNECT_TIMEOUT", "0.5")
    assert main(["status", "--etcd", f"http://127.0.0.1:{free_port()}", "--job-id", "j"]) == 1
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "Check that etcd runs" in said[0], said
    assert "embedded etcd that ended with it" in said[0], said


def test_report_without_matplotlib_prints_its_tables_and_succeeds(tmp_path, capsys, monkeypatch):
    import json
    import sys

    from elastic.launch.report import report

    (tmp_path / "events-h-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"t": 1.0, "event": "joined", "pid": 1, "worker": "h-1", "member": "m1"},
        {"t": 2.0, "event": "resumed", "reason": "start", "pid": 1, "worker": "h-1",
         "member": "m1", "round": 1, "rank": 0, "world_size": 1, "recovery_s": 1.0}]))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it raises ImportError
    assert report(str(tmp_path)) == 0
    shown = capsys.readouterr()
    assert "matplotlib is missing" in shown.err and shown.out.strip()
