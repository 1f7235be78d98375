"""Pure tests of TrainState: registry, attribute routing, commit/restore, payloads, stores."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch import nn

from elastic.state import ElasticSampler, NoCommitError, StateError, StateKeyError, TrainState
from elastic.state.stateful import is_stateful, snapshot

pytestmark = [pytest.mark.timeout(60), pytest.mark.unit]


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    return model, opt


def _step(model, opt):
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).sum().backward()
    opt.step()


def _assert_tree_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for key in a:
            _assert_tree_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_tree_equal(x, y)
    else:
        assert a == b


def test_commit_then_restore_rolls_back_model_optimizer_and_values():
    model, opt = _trained()
    state = TrainState(model=model, optimizer=opt, epoch=3, lr=[0.1, {"w": torch.ones(2)}])
    assert state.commit() == 1
    saved_model = snapshot(model.state_dict())
    saved_opt = snapshot(opt.state_dict())
    _step(model, opt)
    state.epoch += 1
    state.lr[1]["w"].add_(5)
    state.restore()
    _assert_tree_equal(saved_model, model.state_dict())
    _assert_tree_equal(saved_opt, opt.state_dict())
    assert state.epoch == 3 and torch.equal(state.lr[1]["w"], torch.ones(2))


def test_plain_containers_and_tensors_come_back_as_the_objects_and_kinds_the_loop_holds():
    # A commit holds plain dicts, and restore() built new values: a Counter or defaultdict
    # came back a dict (the next `seen[k] += 1` raised KeyError), a namedtuple raised
    # TypeError at every restore (every formation restores), and a tensor that an optimizer
    # also trains was replaced, that optimizer training the old one on, never rolled back.
    best = collections.namedtuple("Best", "loss step")
    temperature = torch.ones(1, requires_grad=True)
    opt = torch.optim.SGD([temperature], lr=0.5)
    state = TrainState(optimizer=opt, seen=collections.Counter(a=1),
                       by_class=collections.defaultdict(int), best=best(1.5, 3),
                       temperature=temperature, history=[1.0])
    seen, history = state.seen, state.history
    state.commit()
    (temperature * 2).sum().backward()
    opt.step()
    state.seen["a"] += 4
    state.history.append(2.0)
    state.best = best(0.5, 9)
    state.restore()
    assert state.seen is seen and state.seen == {"a": 1} and state.seen["b"] == 0
    assert type(state.by_class) is collections.defaultdict and state.by_class[7] == 0
    assert state.best == best(1.5, 3) and type(state.best) is best
    assert state.history is history and history == [1.0]
    assert state.temperature is temperature and torch.equal(temperature.detach(), torch.ones(1))
    assert temperature.requires_grad


def test_a_value_that_state_sync_cannot_send_is_refused_at_its_assignment():
    # A numpy integer assigned to a plain value was accepted, committed, and refused only by
    # the first re-formation that sent the state: the job stopped when a worker died.
    state = TrainState(best_step=0)
    with pytest.raises(TypeError, match=r"best_step.*int64.*\.item\(\)"):
        state.best_step = np.int64(3)
    assert state.best_step == 0
    state.best_step = np.int64(3).item()
    assert state.best_step == 3


def test_restore_leaves_the_commit_untouched_by_later_training():
    model, opt = _trained()
    state = TrainState(model=model, optimizer=opt)
    state.commit()
    state.restore()
    saved = snapshot(opt.state_dict())
    _step(model, opt)  # Adam updates its state in place
    state.restore()
    _assert_tree_equal(saved, opt.state_dict())


def test_commit_reuses_buffers_and_increments_the_version():
    model, opt = _trained()
    state = TrainState(model=model, optimizer=opt)
    assert state.version == 0 and not state.has_commit
    state.commit()
    first = state.committed()["objects"]["model"]["0.weight"]
    _step(model, opt)
    assert state.commit() == 2
    second = state.committed()["objects"]["model"]["0.weight"]
    assert second.data_ptr() == first.data_ptr()
    assert torch.equal(second, model[0].weight.detach())
    assert state.committed()["version"] == 2


def test_plain_values_read_and_write_as_attributes():
    sampler = ElasticSampler(range(10))
    state = TrainState(sampler=sampler, epoch=0)
    state.epoch += 1
    assert state.epoch == 1 and state.sampler is sampler
    state.register("best", None)
    state.best = 0.5
    assert state.best == 0.5 and state.names == ("sampler", "epoch", "best")
    with pytest.raises(AttributeError, match="register"):
        state.typo = 1
    with pytest.raises(AttributeError, match="Stateful"):
        state.sampler = ElasticSampler(range(3))
    with pytest.raises(AttributeError, match="missing"):
        _ = state.missing


def test_registered_objects_read_as_plain_attributes_without_the_fallback_lookup(monkeypatch):
    # A loop reads state.step several times a step; the __getattr__ fallback cost ~2 us a read.
    sampler = ElasticSampler(range(10))
    state = TrainState(sampler=sampler, epoch=0)
    state.register("best", 0.5)

    def fallback(self, name):
        raise AssertionError(f"{name!r} went through __getattr__")

    monkeypatch.setattr(TrainState, "__getattr__", fallback)
    state.epoch += 2
    assert (state.sampler, state.epoch, state.best) == (sampler, 2, 0.5)
    state.commit()
    state.epoch = 7
    state.restore()
    assert state.epoch == 2


def test_a_shallow_copy_that_registers_a_name_leaves_the_original_whole():
    import copy

    state = TrainState(sampler=ElasticSampler(range(10)), epoch=0)
    clone = copy.copy(state)
    clone.register("best", 0.5)
    clone.register("other", ElasticSampler(range(4)))
    assert state.names == ("sampler", "epoch") and clone.names == ("sampler", "other", "epoch", "best")
    assert state.commit() == 1 and clone.commit() == 1


def test_a_registered_name_cannot_be_deleted():
    state = TrainState(sampler=ElasticSampler(range(10)), epoch=0)
    for name in ("sampler", "epoch"):
        with pytest.raises(AttributeError, match="cannot be deleted"):
            delattr(state, name)
    assert state.epoch == 0 and state.names == ("sampler", "epoch")


def test_register_rejects_names_that_clash_with_methods_or_properties():
    for name in ("commit", "version", "restore", "names", "has_commit"):
        with pytest.raises(ValueError, match=f"clashes with TrainState.{name}"):
            TrainState(**{name: 1})
    state = TrainState(epoch=0)
    with pytest.raises(ValueError, match="already registered"):
        state.register("epoch", 1)
    with pytest.raises(ValueError, match="_hidden"):
        state.register("_hidden", 1)
    with pytest.raises(TypeError, match="neither Stateful"):
        state.register("thing", object())


def test_restore_without_a_commit_raises():
    state = TrainState(epoch=0)
    with pytest.raises(NoCommitError, match="commit"):
        state.restore()
    with pytest.raises(StateError, match=r"commit\(\) before save\(\)"):
        state.save(object())


def test_load_committed_installs_a_payload_that_restore_applies():
    model, opt = _trained()
    source = TrainState(model=model, optimizer=opt, epoch=7)
    source.commit()
    source.commit()
    fresh_model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=0.1)
    target = TrainState(model=fresh_model, optimizer=fresh_opt, epoch=0)
    target.load_committed(source.committed())
    assert target.version == 2
    target.restore()
    _assert_tree_equal(model.state_dict(), fresh_model.state_dict())
    _assert_tree_equal(opt.state_dict(), fresh_opt.state_dict())
    assert target.epoch == 7


def test_load_committed_rejects_payloads_naming_other_objects():
    state = TrainState(epoch=0, step=0)
    with pytest.raises(StateKeyError, match=r"missing \['step'\], unknown \['other'\]"):
        state.load_committed({"version": 1, "objects": {"epoch": 1, "other": 2}})
    with pytest.raises(StateKeyError, match="exactly the keys"):
        state.load_committed({"objects": {}})


class _MemoryStore:
    class _Loaded:
        def __init__(self, payload, metadata):
            self.state_dict, self.metadata = payload, metadata

    def __init__(self):
        self.saved = {}

    def save(self, step, state_dict, metadata):
        self.saved[step] = (snapshot(state_dict), metadata)

    def load(self, ref=None):
        step = max(self.saved) if ref is None else ref
        return self._Loaded(*self.saved[step])


def test_save_and_load_go_through_a_duck_typed_store():
    store = _MemoryStore()
    state = TrainState(epoch=4, weights=torch.arange(3.0))
    state.commit()
    state.save(store, metadata={"why": "test"})
    assert list(store.saved) == [1]
    other = TrainState(epoch=0, weights=torch.zeros(3))
    loaded = other.load(store)
    assert loaded.metadata == {"why": "test"}
    assert other.epoch == 4 and torch.equal(other.weights, torch.arange(3.0)) and other.version == 1


def test_stateful_protocol_recognises_modules_optimizers_and_samplers():
    model, opt = _trained()
    assert is_stateful(model) and is_stateful(opt) and is_stateful(ElasticSampler(range(2)))
    assert not is_stateful(3) and not is_stateful(nn.Linear) and not is_stateful(torch.ones(1))


def test_snapshot_preserves_module_metadata_and_copies_to_new_memory():
    model, _ = _trained()
    live = model.state_dict()
    copy = snapshot(live)
    assert copy._metadata == live._metadata
    assert copy["0.weight"].data_ptr() != live["0.weight"].data_ptr()
    assert type(copy._metadata) is type(live._metadata)
    copy._metadata[""]["version"] = 99  # the copy's metadata is its own
    assert live._metadata[""].get("version") != 99


def test_snapshot_shares_immutable_leaves_and_copies_mutable_ones():
    hyper = {"lr": 0.1, "name": "sgd", "nesterov": False, "betas": (0.9, 0.99), "ids": [1, 2],
             "extra": {"k": bytearray(b"x")}}
    copy = snapshot(hyper)
    assert copy == hyper
    assert copy["name"] is hyper["name"]
    assert copy["ids"] is not hyper["ids"] and copy["extra"]["k"] is not hyper["extra"]["k"]
    hyper["ids"].append(3)
    hyper["extra"]["k"] += b"y"
    assert copy["ids"] == [1, 2] and copy["extra"]["k"] == bytearray(b"x")


def test_commit_overwrites_the_previous_commit_in_place_while_the_structure_stays():
    model, opt = _trained()
    sampler = ElasticSampler(range(40), seed=0)
    state = TrainState(model=model, optimizer=opt, sampler=sampler, step=0)
    state.commit()
    first = state.committed()["objects"]
    _step(model, opt)
    opt.param_groups[0]["lr"] = 0.05
    sampler.record_batch(4)
    state.step += 1
    state.commit()
    second = state.committed()["objects"]
    assert second["optimizer"] is first["optimizer"] and second["model"] is first["model"]
    _assert_tree_equal(second["model"], snapshot(model.state_dict()))
    _assert_tree_equal(second["optimizer"], snapshot(opt.state_dict()))
    _assert_tree_equal(second["sampler"], sampler.state_dict())
    assert second["optimizer"]["param_groups"][0]["lr"] == 0.05 and second["step"] == 1
    _step(model, opt)  # training after the commit leaves it untouched
    assert not torch.equal(second["model"]["0.weight"], model[0].weight.detach())


@pytest.mark.parametrize("change", ["new optimizer state", "tensor shape", "tuple item",
                                    "list length", "key order", "nested leaf type"])
def test_snapshot_over_a_snapshot_of_another_structure_equals_a_fresh_snapshot(change):
    before = {"opt": {"state": {}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
              "w": torch.ones(3), "nested": {"a": torch.zeros(2), "b": [1, torch.ones(1)]},
              "order": {"x": 1, "y": 2}}
    after = snapshot(before)
    if change == "new optimizer state":
        after["opt"]["state"][0] = {"step": torch.tensor(1.0), "exp_avg": torch.randn(3)}
    elif change == "tensor shape":
        after["w"] = torch.randn(4)
    elif change == "tuple item":
        after["opt"]["groups"][0]["betas"] = (0.8, 0.99)
    elif change == "list length":
        after["opt"]["groups"][0]["params"] = [0, 1]
    elif change == "key order":
        after["order"] = {"y": 2, "x": 1}
    else:
        after["nested"]["b"] = [1, bytearray(b"z")]
    after["nested"]["a"] = torch.randn(2)  # a sibling that still fits
    copy = snapshot(after, snapshot(before))
    _assert_tree_equal(copy, after)
    assert list(copy["order"]) == list(after["order"])
    for key in ("w", "nested"):
        assert copy[key] is not after[key]
    assert copy["nested"]["a"].data_ptr() != after["nested"]["a"].data_ptr()
