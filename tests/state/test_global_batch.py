"""Pure tests of issue 5's pieces: constant global batch, loss weighting, RNG state, LR scaling."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from elastic.state import (ElasticSampler, LinearLRScaling, RNGState, SeededDataset, SqrtLRScaling,
                   StateError, TrainState, sample_seed)
from elastic.state.global_batch import share_of

pytestmark = [pytest.mark.timeout(60), pytest.mark.unit]


def _ranks(n, b, world, state=None, **kwargs):
    samplers = []
    for rank in range(world):
        sampler = ElasticSampler(range(n), seed=3, global_batch_size=b, **kwargs)
        if state is not None:
            sampler.load_state_dict(state)
        sampler.set_topology(rank, world)
        samplers.append(sampler)
    return samplers


def _steps(samplers, count):
    """Trains ``count`` global steps in lockstep; returns each step's real samples."""
    iters = [iter(s) for s in samplers]
    trained = []
    for _ in range(count):
        shares = [next(it) for it in iters]
        real = []
        for sampler, share in zip(samplers, shares):
            if sampler.share().size:
                real += share
            sampler.record_batch(len(share))
        trained.append(real)
    return trained


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_global_step_k_trains_the_same_samples_whatever_the_world_size(world):
    perm = ElasticSampler(range(50), seed=3)._permutation()
    trained = _steps(_ranks(50, 8, world), 7)
    for k, real in enumerate(trained):
        assert real == perm[k * 8:k * 8 + 8]  # contiguous shares in rank order
    assert trained[-1] == perm[48:]  # the last global batch holds the 2 samples left


def test_shares_are_contiguous_and_differ_by_at_most_one_sample():
    for total, world in [(12, 5), (7, 3), (2, 3), (12, 4)]:
        shares = [share_of(0, total, total, r, world) for r in range(world)]
        sizes = [s.size for s in shares]
        assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
        assert [s.start for s in shares if s.size] == [sum(sizes[:r]) for r in range(world)
                                                        if sizes[r]]


def test_a_world_change_mid_epoch_keeps_the_global_batch_boundaries():
    perm = ElasticSampler(range(50), seed=3)._permutation()
    three = _ranks(50, 8, 3)
    first = _steps(three, 2)
    two = _ranks(50, 8, 2, state=three[0].state_dict())
    rest = _steps(two, 5)
    assert [i for step in first + rest for i in step] == perm
    assert two[0].consumed == 50 and two[0].batches_done == 7


def test_loss_scale_makes_ddp_averaging_equal_the_global_batch_mean():
    torch.manual_seed(0)
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ((x @ w - y) ** 2).mean().backward()
    expected, w.grad = w.grad.clone(), None
    world, grads = 3, []
    for rank in range(world):  # 7 samples over 3 ranks: shares 3, 2, 2
        share = share_of(0, 7, 7, rank, world)
        rows = list(share.positions)
        loss = ((x[rows] @ w - y[rows]) ** 2).sum() * share.loss_scale
        grads.append(torch.autograd.grad(loss, w)[0])
    assert torch.allclose(sum(grads) / world, expected, atol=1e-14, rtol=0)


def test_a_rank_without_a_sample_trains_one_dummy_sample_with_weight_zero():
    samplers = _ranks(10, 8, 3)
    _steps(samplers, 1)
    shares = [s.share() for s in samplers]  # last global batch: 2 samples over 3 ranks
    assert [s.size for s in shares] == [1, 1, 0]
    assert shares[2].loss_scale == 0.0 and len(shares[2].positions) == 1
    assert [len(list(s)) for s in samplers] == [1, 1, 1]
    assert [len(batch) for s in samplers for batch in s] == [1, 1, 1]


def test_drop_last_skips_the_short_last_global_batch():
    samplers = _ranks(20, 8, 2, drop_last=True)
    assert [len(s) for s in samplers] == [2, 2]
    _steps(samplers, 2)
    assert samplers[0].consumed == 20 and samplers[0].skipped == 4
    assert len(samplers[0].skipped_indices()) == 4 and list(samplers[0]) == []


def test_record_batch_with_the_wrong_share_length_names_the_fix():
    sampler = _ranks(20, 8, 2)[0]
    with pytest.raises(ValueError, match="batch_sampler"):
        sampler.record_batch(8)


def test_share_outside_global_batch_mode_says_how_to_enable_it():
    with pytest.raises(StateError, match="global_batch_size"):
        ElasticSampler(range(10)).share()
    with pytest.raises(ValueError, match="only one"):
        ElasticSampler(range(10), batch_size=2, global_batch_size=4)


def test_a_dataloader_with_the_sampler_as_batch_sampler_yields_the_shares():
    sampler = _ranks(30, 8, 3)[1]
    loader = DataLoader(list(range(30)), batch_sampler=sampler)
    perm = sampler._permutation()
    batches = [b.tolist() for b in loader]
    assert len(loader) == 4 and batches[0] == perm[3:6] and batches[3] == perm[26:28]


def _draws():
    return (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])


def test_rng_state_replays_torch_numpy_and_python_after_a_rollback():
    state = TrainState(rng=RNGState(), step=0)
    state.commit()
    first = _draws()
    state.restore()
    assert _draws() == first
    state.rng.load_state_dict(state.rng.state_dict())  # round trip keeps the position
    after = _draws()
    state.restore()
    assert _draws() == first and after != first


class _Noisy(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.rand(()).item() + np.random.rand() + random.random()


def test_seeded_dataset_gives_a_sample_the_same_randomness_in_any_process():
    sampler = ElasticSampler(range(8), seed=5)
    sampler.set_epoch(2)
    data = SeededDataset(_Noisy(), sampler)
    torch.manual_seed(0)
    main = [data[i] for i in range(8)]
    in_workers = [float(v) for v in DataLoader(data, batch_size=None, num_workers=2)]
    assert in_workers == main
    sampler.set_epoch(3)
    assert [data[i] for i in range(8)] != main


def test_seeded_dataset_leaves_the_main_process_stream_alone():
    data = SeededDataset(_Noisy(), ElasticSampler(range(8)))
    torch.manual_seed(0)
    expected = torch.rand(2).tolist()
    torch.manual_seed(0)
    data[3]
    assert torch.rand(2).tolist() == expected


def test_sample_seed_is_deterministic_and_spreads_neighbours():
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3)
    assert len({sample_seed(7, 0, p) for p in range(1000)}) == 1000
    assert all(0 <= sample_seed(7, 0, p) < 2**63 for p in range(100))


def test_lr_scaling_follows_the_world_size_without_compounding():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    linear = LinearLRScaling(opt, base_world_size=2)
    for world in (3, 4, 4, 1, 2):
        linear(SimpleNamespace(world_size=world))
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * world / 2)
    sqrt = SqrtLRScaling(opt, base_lr=0.2, base_world_size=4)
    for world in (1, 9, 9):
        sqrt(SimpleNamespace(world_size=world))
        assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * (world / 4) ** 0.5)
    with pytest.raises(ValueError, match="one rate per group"):
        LinearLRScaling(opt, base_lr=[0.1, 0.2])
