"""The skeleton's wire form: every kind of committed state goes through, and nothing a peer sends
can run code or come back as anything but the documented types."""

from __future__ import annotations

import json
import math
import pickle
from collections import OrderedDict, namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from elastic.state import ElasticSampler, RNGState, SyncError
from elastic.state.errors import PayloadFormatError
from elastic.state.sync import fill_tensors
from elastic.state.wire import MAX_DEPTH, TensorSlot, decode, encode
from tests.workers.hostile_member import RunsCode

pytestmark = [pytest.mark.timeout(60), pytest.mark.unit]


def _round_trip(payload):
    tensors: list[torch.Tensor] = []
    skeleton = decode(encode(payload, tensors))
    return fill_tensors(skeleton, tensors)


def _assert_same(a, b, where="payload"):
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}.{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def test_a_trained_model_optimizer_sampler_and_rng_state_come_back_equal():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    scheduler.step()
    sampler = ElasticSampler(range(50), seed=3, batch_size=4)
    sampler.record_batch(4)
    payload = {"version": 7, "objects": {
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(),
        "rng": RNGState().state_dict(), "scaler": torch.amp.GradScaler("cpu").state_dict()}}
    _assert_same(payload, _round_trip(payload))


def test_plain_values_of_every_documented_kind_come_back_equal():
    values = {"int": 3, "big": 10**40, "neg": -5, "float": 0.1, "nan": math.nan,
              "inf": -math.inf, "complex": 2 - 1.5j, "str": "text é", "bytes": b"\x00\xff",
              "bool": True, "none": None, "tuple": (1, ("a", None)), "list": [[], {}],
              "int keys": {0: "a", 5: {"step": torch.tensor(3.0)}}, "tuple key": {(1, "x"): 2},
              "dtype": torch.bfloat16, "device": torch.device("cpu"),
              "tensors": [torch.arange(6).reshape(2, 3), torch.empty(0, 4),
                          torch.tensor(True), torch.randn(2).half()]}
    _assert_same(values, _round_trip(values))


def test_module_metadata_and_ordered_dicts_survive_and_namedtuples_arrive_as_tuples():
    state = nn.BatchNorm1d(2).state_dict()
    assert state._metadata  # what load_state_dict reads for version upgrades
    _assert_same(state, _round_trip(state))
    Pair = namedtuple("Pair", "a b")
    assert _round_trip({"pair": Pair(1, 2)}) == {"pair": (1, 2)}


def test_tensors_are_slots_in_the_order_they_are_sent():
    tensors: list[torch.Tensor] = []
    skeleton = decode(encode({"b": torch.zeros(2), "a": [torch.ones(3, dtype=torch.int8)]},
                             tensors))
    assert skeleton == {"b": TensorSlot(0, (2,), torch.float32),
                        "a": [TensorSlot(1, (3,), torch.int8)]}
    assert [t.dtype for t in tensors] == [torch.float32, torch.int8]


@pytest.mark.parametrize("leaf", [np.int64(3), object(), {1, 2}, lambda: 1])
def test_a_value_with_no_wire_form_is_refused_on_the_sender_with_its_path(leaf):
    with pytest.raises(SyncError, match=r"at objects\.opt\.state\.0\.x is a .*make "
                                        r"state_dict\(\) return int, float"):
        encode({"objects": {"opt": {"state": [{"x": leaf}]}}}, [])


def test_a_pickle_is_refused_and_what_it_would_run_never_runs(tmp_path: Path):
    data = pickle.dumps({"objects": RunsCode(str(tmp_path))})
    with pytest.raises(PayloadFormatError, match="not JSON"):
        decode(data)
    pickle.loads(data)  # the control: unpickling it does run code
    ran = list(tmp_path.glob("code-ran-*"))
    assert len(ran) == 1
    ran[0].unlink()
    with pytest.raises(PayloadFormatError):
        decode(json.dumps(["b", "gASV"]).encode() + data)
    assert not list(tmp_path.glob("code-ran-*"))


HOSTILE = {
    "untagged object": {"__class__": "os.system"},
    "unknown tag": ["pickle", "gASV"],
    "tag not a string": [1, 2],
    "empty list": [],
    "slot out of order": ["l", ["s", 1, [2], "float32"]],
    "slot index a bool": ["s", True, [2], "float32"],
    "negative size": ["s", 0, [-1], "float32"],
    "float size": ["s", 0, [2.5], "float32"],
    "unknown dtype": ["s", 0, [2], "Tensor"],
    "dtype attribute": ["y", "__class__"],
    "slot arity": ["s", 0, [2]],
    "slot in a key": ["d", [["s", 0, [1], "float32"], 1]],
    "slot in metadata": ["o", ["s", 0, [1], "float32"]],
    "list key": ["d", [["l", 1], 2]],
    "unhashable in tuple key": ["d", [["t", ["l"]], 2]],
    "pair not a pair": ["d", ["a", 1, 2]],
    "bad base64": ["b", "!!"],
    "non-finite name": ["f", "NaN!"],
    "complex of strings": ["c", "1", "2"],
    "device garbage": ["v", "warp-drive:9"],
    "too many dims": ["s", 0, [1] * 65, "float32"],
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_malformed_skeleton_is_refused_with_a_payload_format_error(name):
    with pytest.raises(PayloadFormatError):
        decode(json.dumps(HOSTILE[name]).encode())


@pytest.mark.parametrize("raw", [b"NaN", b"[\"l\", Infinity]", b"\xff\xfe", b"[" * 100_000,
                                 b"1" * 10_000])
def test_non_standard_json_deep_nesting_and_giant_numbers_are_refused(raw):
    with pytest.raises(PayloadFormatError):
        decode(raw)


def test_nesting_deeper_than_the_limit_is_refused_on_both_sides():
    deep: object = 1
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(SyncError, match="nested deeper"):
        encode(deep, [])
    wire: object = 1
    for _ in range(MAX_DEPTH + 1):
        wire = ["l", wire]
    with pytest.raises(PayloadFormatError, match="nested deeper"):
        decode(json.dumps(wire).encode())
