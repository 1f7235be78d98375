"""What is read from etcd is checked before use: join requests, plans, seats and the round
counter (pure: bytes in, a value or a typed error out; no etcd)."""

from __future__ import annotations

import json
import logging
import pickle

import pytest

from elastic.cluster.rounds import records
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.plan import JoinRequest, Plan
from elastic.cluster.rounds.records import RecordError, SkippedRecords
from elastic.cluster.rounds.seat import Seat, lineage, seat_in, seats_of
from elastic.foundation.errors import EtcdRecordError

pytestmark = pytest.mark.unit

GOOD = {"member_id": "node-1-42-ab12cd", "version": 3, "reason": "change", "addr": "10.0.0.7",
        "port": 29500}


def _join(**changes) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


def test_a_well_formed_join_request_is_read_with_its_revision():
    assert JoinRequest.from_json(_join(), 9, "node-1-42-ab12cd") == JoinRequest(
        "node-1-42-ab12cd", 3, "change", "10.0.0.7", 29500, revision=9)
    for addr in ("fd00::1", "worker-3.cluster.local"):
        assert JoinRequest.from_json(_join(addr=addr), 1, "node-1-42-ab12cd").addr == addr


MALFORMED = {
    "pickle": pickle.dumps(GOOD),
    "not utf-8": b"\xff\xfe",
    "not an object": b"[1, 2]",
    "NaN constant": _join(version=0)[:-1] + b', "x": NaN}',
    "unknown field": _join(__class__="os.system"),
    "missing field": json.dumps({k: v for k, v in GOOD.items() if k != "port"}).encode(),
    "version a string": _join(version="7"),
    "version a bool": _join(version=True),
    "version a float": _join(version=3.0),
    "version negative": _join(version=-1),
    "version beyond int64": _join(version=2**63),
    "port out of range": _join(port=70000),
    "port zero": _join(port=0),
    "unknown reason": _join(reason="root"),
    "address with a slash": _join(addr="10.0.0.1/evil"),
    "address a list": _join(addr=["10.0.0.1"]),
    "member id of another key": _join(member_id="node-2-1-ffffff"),
    "member id with a slash": _join(member_id="a/b"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_join_request_is_a_record_error(name):
    with pytest.raises(RecordError):
        JoinRequest.from_json(MALFORMED[name], 1, "node-1-42-ab12cd")


def test_a_plan_is_checked_against_its_round_and_its_fields():
    plan = Plan(round=4, ranks=["a-1-x", "b-2-y"], spares=["c-3-z"], master_addr="10.0.0.2",
                master_port=29400, versions={"a-1-x": 5, "b-2-y": 5, "c-3-z": 1})
    raw = plan.to_json().encode()
    assert Plan.from_json(raw, 4) == plan
    assert b'"versions": [5, 5, 1]' in raw  # by position in ranks, then spares
    by_id = raw.replace(b'[5, 5, 1]', b'{"a-1-x": 5, "b-2-y": 5, "c-3-z": 1}')
    assert Plan.from_json(by_id, 4) == plan  # as plans were once stored
    for bad in (raw.replace(b'"round": 4', b'"round": 5'),
                raw.replace(b'"master_port": 29400', b'"master_port": -1'),
                raw.replace(b'"ranks": ["a-1-x", "b-2-y"]', b'"ranks": []'),
                raw.replace(b'"ranks": ["a-1-x", "b-2-y"]', b'"ranks": ["a-1-x", "a-1-x"]'),
                raw.replace(b'"ranks": ["a-1-x", "b-2-y"]', b'"ranks": ["a-1-x", "b/2-y"]'),
                raw.replace(b'"ranks": ["a-1-x", "b-2-y"]', b'"ranks": ["a-1-x", 7]'),
                raw.replace(b'"ranks": ["a-1-x", "b-2-y"]', b'"ranks": ["a-1-x", "b 2"]'),
                raw.replace(b'"ranks": ["a-1-x", "b-2-y"]', b'"ranks": ["a-1-x", "\\n"]'),
                raw.replace(b'"spares": ["c-3-z"]', b'"spares": [""]'),
                raw.replace(b'[5, 5, 1]', b'[5, "5", 1]'),
                raw.replace(b'[5, 5, 1]', b'[5, 5]'),
                raw.replace(b'[5, 5, 1]', b'[5, -1, 1]'),
                by_id.replace(b'"b-2-y": 5', b'"b/2-y": 5'),
                by_id.replace(b'"b-2-y": 5', b'"b-2-y": "5"'), b"garbage"):
        assert bad != raw
        with pytest.raises(RecordError):
            Plan.from_json(bad, 4)


def test_a_plan_seats_each_member_it_names_and_only_rank_0_is_told_every_rank():
    plan = Plan(round=7, ranks=["a-1-x", "b-2-y", "c-3-z"], spares=["s-4-w"], cut=["k-5-v"],
                master_addr="10.0.0.7", master_port=29400)
    seats = seats_of(plan)
    assert set(seats) == {"a-1-x", "b-2-y", "c-3-z", "s-4-w", "k-5-v"}
    assert seats["a-1-x"].ranks == ("a-1-x", "b-2-y", "c-3-z") and seats["c-3-z"].ranks == ()
    assert seats["c-3-z"] == Seat(round=7, place="rank", rank=2, world_size=3,
                                  master_addr="10.0.0.7", master_port=29400, rank0="a-1-x",
                                  lineage=lineage(7, plan.ranks))
    assert (seats["s-4-w"].place, seats["k-5-v"].place) == ("spare", "cut")
    assert seat_in(plan, "b-2-y") == seats["b-2-y"] and seat_in(plan, "z-9-q") is None
    for seat in seats.values():
        assert Seat.from_json(seat.to_json().encode()) == seat
    big = Plan(round=7, ranks=[f"m-{i}-x" for i in range(1000)])
    assert len(seat_in(big, "m-500-x").to_json()) < 200 < len(big.to_json()) / 10


@pytest.mark.parametrize("changes", [{"rank": 3}, {"rank": -1}, {"place": "chair"},
                                     {"world_size": 0}, {"rank0": "a/b"}, {"lineage": 0},
                                     {"ranks": ["a-1-x"]}, {"extra": 1}])
def test_a_malformed_seat_is_a_record_error(changes):
    good = json.loads(seats_of(Plan(round=2, ranks=["a-1-x", "b-2-y", "c-3-z"]))["a-1-x"]
                      .to_json())
    Seat.from_json(json.dumps(good).encode())
    with pytest.raises(RecordError):
        Seat.from_json(json.dumps({**good, **changes}).encode())


@pytest.mark.parametrize("raw", [b"x", b"-1", b"0", b"\xc2\xb2", b"1e3", b"123456789"])
def test_a_round_counter_that_is_not_a_round_number_is_an_error_naming_key_and_fix(raw):
    with pytest.raises(EtcdRecordError, match=r"^the record at /elastic/j/round is malformed .*"
                                              r"Restrict who can write it"):
        records.round_number("/elastic/j/round", raw)
    assert records.round_number("/elastic/j/round", b"12") == 12


def test_a_key_with_a_non_ascii_digit_is_no_round():
    keys = JobKeys("j")
    assert keys.round_of(keys.rounds + "\u00b2/join/x") is None
    assert keys.round_of(keys.join(3, "x")) == 3


def test_a_skipped_record_is_warned_once_per_key_and_revision(caplog):
    skipped = SkippedRecords()
    with caplog.at_level(logging.WARNING, logger="elastic.cluster.rounds.records"):
        for _ in range(3):
            skipped.skip("/elastic/j/rounds/00000002/join/evil", 7, "not JSON")
        skipped.skip("/elastic/j/rounds/00000002/join/evil", 8, "not JSON")
    assert [r.getMessage() for r in caplog.records] == [
        "skipped the record at /elastic/j/rounds/00000002/join/evil: not JSON"] * 2
