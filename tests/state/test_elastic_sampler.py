"""Pure tests of ElasticSampler: partition, exactly-once across re-formations, state."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from elastic.state import ElasticSampler, StateError, StateKeyError
from elastic.state.sampler import split_counts

pytestmark = [pytest.mark.timeout(60), pytest.mark.unit]


def _samplers(n, world, state=None, batch_hint=None, **kwargs):
    out = []
    for rank in range(world):
        sampler = ElasticSampler(range(n), batch_size=batch_hint, **kwargs)
        if state is not None:
            sampler.load_state_dict(state)
        sampler.set_topology(rank, world)
        out.append(sampler)
    return out


def _run_split(samplers, batch, max_batches, ledger):
    """Every rank pulls and records up to max_batches batches in lockstep, DataLoader-style.

    Returns whether the ranks ran out of batches (end of epoch for this split).
    """
    iters = [iter(s) for s in samplers]
    for _ in range(max_batches):
        batches = [list(itertools.islice(it, batch)) for it in iters]
        have = [bool(b) for b in batches]
        assert len(set(have)) == 1, f"ranks disagree on having a batch: {have}"
        if not have[0]:
            return True
        for sampler, items in zip(samplers, batches):
            ledger.extend(items)
            sampler.record_batch(len(items))
        states = [s.state_dict() for s in samplers]
        assert all(st == states[0] for st in states), states
    return False


def test_sampler_hands_out_each_index_once_across_world_changes():
    for seed in range(300):
        rng = random.Random(seed)
        n = rng.randint(0, 120)
        batch = rng.randint(1, 9)
        hint = batch if rng.random() < 0.5 else None
        drop_last = rng.random() < 0.3
        ledger: list[int] = []
        state = None
        for _ in range(200):
            world = rng.randint(1, 5)
            samplers = _samplers(n, world, state, hint, seed=seed, drop_last=drop_last)
            for s in samplers:
                s.set_epoch(0)
            done = _run_split(samplers, batch, rng.randint(0, 4), ledger)
            state = samplers[0].state_dict()
            if done or state["consumed"] == n:
                break
        else:
            pytest.fail(f"seed {seed}: the epoch never finished")
        final = samplers[0]
        skipped = final.skipped_indices()
        assert len(skipped) == final.skipped
        assert len(ledger) == len(set(ledger)), f"seed {seed}: an index was handed out twice"
        assert sorted(ledger + skipped) == list(range(n)), f"seed {seed}: ledger incomplete"
        assert final.consumed == n


def test_sampler_gives_every_rank_the_same_number_of_batches_in_every_split():
    for n, world, batch, consumed in itertools.product(range(0, 40), range(1, 6), range(1, 6), (0, 3)):
        state = ElasticSampler(range(n)).state_dict()
        state["consumed"] = min(consumed, n)
        per_rank = [list(s) for s in _samplers(n, world, state, batch_hint=batch)]
        counts = {-(-len(items) // batch) for items in per_rank}
        assert len(counts) == 1, (n, world, batch, [len(p) for p in per_rank])
        sizes = [len(p) for p in per_rank]
        assert max(sizes) - min(sizes) <= 1 or min(sizes) % batch == 0
        flat = [i for p in per_rank for i in p]
        assert len(flat) == len(set(flat))


def test_sampler_skips_a_tail_smaller_than_the_world():
    assert split_counts(remaining=10, world_size=3, batch_size=3, drop_last=False) == [3, 3, 3]
    assert split_counts(remaining=11, world_size=3, batch_size=3, drop_last=False) == [3, 3, 3]
    assert split_counts(remaining=13, world_size=3, batch_size=3, drop_last=False) == [5, 4, 4]
    assert split_counts(remaining=13, world_size=3, batch_size=3, drop_last=True) == [3, 3, 3]
    samplers = _samplers(10, 3, batch_hint=3, shuffle=False)
    ledger: list[int] = []
    assert _run_split(samplers, 3, 10, ledger)
    assert samplers[0].skipped == 1 and samplers[0].skipped_indices() == [9]
    assert sorted(ledger) == list(range(9))


def test_sampler_skips_everything_when_no_rank_can_have_a_batch():
    samplers = _samplers(2, 3, batch_hint=4, shuffle=False)
    assert [list(s) for s in samplers] == [[], [], []]
    assert samplers[2].consumed == 2 and samplers[2].skipped_indices() == [0, 1]


def test_sampler_permutation_depends_only_on_seed_and_epoch():
    a, b = ElasticSampler(range(50), seed=3), ElasticSampler(range(50), seed=3)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b)
    b.set_epoch(3)
    assert list(a) != list(b)
    assert list(ElasticSampler(range(5), shuffle=False)) == [0, 1, 2, 3, 4]


def test_set_epoch_with_the_current_epoch_keeps_the_position():
    sampler = ElasticSampler(range(20), batch_size=4, shuffle=False)
    sampler.set_epoch(1)
    it = iter(sampler)
    first = [next(it) for _ in range(4)]
    sampler.record_batch(4)
    sampler.set_epoch(1)
    rest = list(sampler)
    assert sampler.batches_done == 1 and sampler.consumed == 4
    assert first + rest == list(range(20))


def test_set_epoch_with_a_new_epoch_starts_from_its_beginning():
    sampler = ElasticSampler(range(20), batch_size=4)
    list(itertools.islice(iter(sampler), 4))
    sampler.record_batch(4)
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.consumed, sampler.batches_done, sampler.skipped) == (1, 0, 0, 0)
    assert len(list(sampler)) == 20


def test_sampler_state_dict_round_trips_and_resumes_from_consumed():
    source = ElasticSampler(range(30), seed=7, batch_size=5)
    source.set_epoch(4)
    list(itertools.islice(iter(source), 5))
    source.record_batch(5)
    state = source.state_dict()
    assert set(state) == {"format_version", "epoch", "seed", "consumed", "batches_done",
                          "batch_size", "skipped"}
    copy = ElasticSampler(range(30), seed=0)
    copy.load_state_dict(state)
    assert copy.state_dict() == state
    assert list(copy) == source._permutation()[5:]


def test_sampler_load_state_dict_rejects_missing_and_unknown_keys():
    sampler = ElasticSampler(range(10))
    state = sampler.state_dict()
    del state["seed"]
    state["extra"] = 1
    with pytest.raises(StateKeyError, match=r"missing keys \['seed'\].*unknown keys \['extra'\]"):
        sampler.load_state_dict(state)
    bad = sampler.state_dict() | {"consumed": 11}
    with pytest.raises(StateError, match="consumed"):
        sampler.load_state_dict(bad)


def test_set_topology_rejects_a_rank_outside_the_world():
    sampler = ElasticSampler(range(10))
    with pytest.raises(ValueError, match=r"rank \(3\).*world_size \(3\)"):
        sampler.set_topology(3, 3)
    with pytest.raises(ValueError, match=r"world_size \(0\)"):
        sampler.set_topology(0, 0)


def test_sampler_len_matches_what_iteration_yields():
    sampler = ElasticSampler(range(23), batch_size=4)
    sampler.set_topology(1, 3)
    assert len(sampler) == len(list(sampler))


def _loader_indices(num_workers):
    data = TensorDataset(torch.arange(37))
    sampler = ElasticSampler(data, seed=5, batch_size=4)
    sampler.set_topology(1, 2)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=num_workers)
    seen = []
    for (x,) in loader:
        seen.extend(x.tolist())
        sampler.record_batch(len(x))
        if sampler.batches_done == 2:
            break
    sampler.set_topology(0, 3)  # a re-formation mid-epoch
    for (x,) in DataLoader(data, batch_size=4, sampler=sampler, num_workers=num_workers):
        seen.extend(x.tolist())
        sampler.record_batch(len(x))
    return seen, sampler.state_dict()


@pytest.mark.timeout(120)
def test_dataloader_with_two_workers_yields_the_same_indices_as_without():
    assert _loader_indices(2) == _loader_indices(0)


def test_more_workers_than_samples_warns_once_on_rank_zero_that_the_epoch_trains_nothing(caplog):
    import logging
    dataset = list(range(3))
    for rank in range(4):
        sampler = ElasticSampler(dataset, seed=0)
        sampler.set_topology(rank, 4)
        with caplog.at_level(logging.WARNING, logger="elastic.state.sampler"):
            assert list(sampler) == []
    warnings = [r.getMessage() for r in caplog.records if "trains no sample" in r.getMessage()]
    assert warnings == ["ElasticSampler: epoch 0 trains no sample: 3 samples are too few for 4 "
                        "ranks, so all of them are skipped. Use at most 3 workers, or a larger "
                        "dataset."]
