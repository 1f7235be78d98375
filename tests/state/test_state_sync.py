"""TrainState.sync over a real 3-process gloo group (spawned processes, FileStore, loopback)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.state import ElasticSampler, NoCommitError, TrainState
from elastic.state.sync import TensorSlot, broadcast_payload, newest_source, plan_buckets
from elastic.state.wire import encode
from tests.support.gloo_group import run_in_group
from tests.support.trees import assert_same_tree

WORLD = 3
SOURCE = 1


def _build(rank: int) -> TrainState:
    torch.manual_seed(100 + rank)  # every rank starts different
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sampler = ElasticSampler(range(100), seed=rank, batch_size=4)
    return TrainState(model=model, optimizer=opt, sampler=sampler, epoch=rank,
                      mask=torch.tensor([True, False, bool(rank)]))


def _fingerprint(state: TrainState) -> dict:
    from elastic.state.stateful import snapshot
    return snapshot({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                     "sampler": state.sampler.state_dict(), "epoch": state.epoch,
                     "mask": state.mask, "version": state.version})


def _sync_on_every_rank(rank: int, world: int) -> tuple[dict, dict]:
    assert world == WORLD
    state = _build(rank)
    with pytest.raises(NoCommitError):  # nobody has committed: every rank raises
        state.sync(SOURCE)
    if rank == SOURCE:  # only the source trains; the others keep empty Adam state
        for _ in range(3):
            state.optimizer.zero_grad()
            state.model(torch.randn(8, 6)).sum().backward()
            state.optimizer.step()
            state.sampler.record_batch(4)
        state.commit()
        state.commit()
    state.sync(SOURCE, timeout=datetime.timedelta(seconds=30))
    mixed = {"f": torch.randn(40), "b": torch.rand(7) > 0.5, "h": torch.randn(3, 5).bfloat16(),
             "i": torch.arange(50), "e": torch.empty(0, 3), "s": "text", "n": [1, (2, None)]}
    got = broadcast_payload(mixed if rank == SOURCE else None, SOURCE, cap_bytes=64,
                            timeout=datetime.timedelta(seconds=30))
    fingerprint = _fingerprint(state)
    dist.barrier()
    return fingerprint, got


def test_bucket_plan_groups_by_dtype_and_respects_the_cap():
    tensors: list[torch.Tensor] = []
    encode({"a": torch.zeros(10), "b": torch.zeros(3, dtype=torch.int64),
            "c": torch.zeros(30), "d": torch.zeros(2)}, tensors)
    slots = [TensorSlot(i, tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
    buckets = plan_buckets(slots, cap_bytes=48)
    assert [[s.index for s in b] for b in buckets] == [[0], [2], [3], [1]]
    assert all(len({s.dtype for s in b}) == 1 for b in buckets)


@pytest.mark.timeout(150)
def test_sync_makes_a_receiver_with_empty_optimizer_state_equal_to_the_source(tmp_path):
    got = run_in_group(_sync_on_every_rank, WORLD, tmp_path)
    source, source_mixed = got[SOURCE]
    assert source["version"] == 2 and source["optimizer"]["state"], "the source trained"
    for rank in range(WORLD):
        assert_same_tree(source, got[rank][0], f"rank {rank}")
        assert_same_tree(source_mixed, got[rank][1], f"rank {rank} mixed")


def _sync_an_unsendable_value(rank: int, world: int) -> str:
    import numpy as np
    from elastic.state import SyncError
    payload = {"version": 1, "objects": {"step": np.int64(3)}} if rank == 0 else None
    try:
        broadcast_payload(payload, 0, timeout=datetime.timedelta(seconds=30))
    except SyncError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(150)
def test_a_source_whose_state_has_no_wire_form_fails_every_rank_at_once_naming_the_value(tmp_path):
    got = run_in_group(_sync_an_unsendable_value, 2, tmp_path)
    assert "objects.step is a numpy.int64" in got[0]
    assert "global rank 0 could not encode its committed state" in got[1]


def _sources(rank: int, world: int) -> list[tuple[int, bool, bool]]:
    cases = [  # (version, lineage) of each rank, and rank 0's newest durable version
        ([(5, 77)] * 3, 0),                      # the survivors of one round
        ([(5, 0)] * 3, 0),                       # equal versions, but no round behind them
        ([(5, 77), (5, 77), (4, 77)], 0),        # one rank a commit behind
        ([(5, 77), (5, 77), (5, 78)], 0),        # the same version made in another round
        ([(5, 77)] * 3, 9),                      # a newer durable checkpoint
    ]
    got = []
    for ranks, durable in cases:
        version, lineage = ranks[rank]
        source = newest_source(version, durable if rank == 0 else 0, lineage=lineage)
        got.append((source.rank, source.from_durable, source.held_by_all))
    return got


@pytest.mark.timeout(150)
def test_only_ranks_of_one_version_made_in_one_round_skip_the_broadcast(tmp_path):
    got = run_in_group(_sources, WORLD, tmp_path)
    assert got[0] == got[1] == got[2], "every rank must get the same answer"
    assert got[0] == [(0, False, True), (0, False, False), (0, False, False),
                      (0, False, False), (0, True, False)]
