"""TrainState.sync over a real gloo group of 3 or 4 spawned processes (FileStore, loopback)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.state import ElasticSampler, NoCommitError, TrainState
from elastic.state.feed import Packing, feed_payload, plan_pieces
from elastic.state.sync import TensorSlot, newest_source, plan_buckets
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
    got = feed_payload(mixed if rank == SOURCE else None, SOURCE,
                       timeout=datetime.timedelta(seconds=30),
                       packing=Packing(direct_bytes=100, cap_bytes=64)).payload
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


def test_large_tensors_travel_alone_and_the_small_ones_in_dtype_buckets():
    tensors: list[torch.Tensor] = []
    encode({"a": torch.zeros(10), "b": torch.zeros(3, dtype=torch.int64), "c": torch.zeros(30),
            "d": torch.zeros(2), "e": torch.zeros(0)}, tensors)
    slots = [TensorSlot(i, tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
    pieces = plan_pieces(slots, Packing(direct_bytes=40, cap_bytes=64))
    assert [[s.index for s in p] for p in pieces] == [[0], [2], [1], [3]]


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
        feed_payload(payload, 0, timeout=datetime.timedelta(seconds=30))
    except SyncError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(150)
def test_a_source_whose_state_has_no_wire_form_fails_every_rank_at_once_naming_the_value(tmp_path):
    got = run_in_group(_sync_an_unsendable_value, 2, tmp_path)
    assert "objects.step is a numpy.int64" in got[0]
    assert "global rank 0 could not encode its committed state" in got[1]


def _sources(rank: int, world: int) -> list[tuple[int, bool, bool, tuple[int, ...]]]:
    cases = [  # (version, lineage) of each rank, and rank 0's newest durable version
        ([(5, 77)] * 3, 0),                      # the survivors of one round
        ([(5, 0)] * 3, 0),                       # equal versions, but no round behind them
        ([(5, 77), (5, 77), (4, 77)], 0),        # one rank a commit behind
        ([(5, 77), (5, 77), (5, 78)], 0),        # the same version made in another round
        ([(5, 77)] * 3, 9),                      # a newer durable checkpoint
        ([(5, 77), (5, 77), (1, 0)], 0),         # a joiner beside two survivors
        ([(1, 0), (6, 80), (6, 80)], 0),         # the survivors behind a joiner's rank
    ]
    got = []
    for ranks, durable in cases:
        version, lineage = ranks[rank]
        source = newest_source(version, durable if rank == 0 else 0, lineage=lineage)
        got.append((source.rank, source.from_durable, source.held_by_all, source.receivers))
    return got


@pytest.mark.timeout(150)
def test_only_ranks_lacking_the_sources_very_commit_are_named_receivers(tmp_path):
    got = run_in_group(_sources, WORLD, tmp_path)
    assert got[0] == got[1] == got[2], "every rank must get the same answer"
    assert got[0] == [(0, False, True, ()), (0, False, False, (1, 2)),
                      (0, False, False, (2,)), (0, False, False, (2,)),
                      (0, True, False, (1, 2)), (0, False, False, (2,)),
                      (1, False, False, (0,))]


CHAIN_SOURCE, BYSTANDER = 2, 1


def _feed_along_a_chain(rank: int, world: int) -> tuple[dict, int, list[int]]:
    """Rank 2 and rank 1 hold the same commit; ranks 0 and 3 hold nothing of it."""
    torch.manual_seed(7 if rank in (CHAIN_SOURCE, BYSTANDER) else rank)
    model = nn.Linear(300, 200)  # a weight of 240 kB travels alone, the bias packed
    state = TrainState(model=model, step=rank)
    state.commit()
    if rank in (CHAIN_SOURCE, BYSTANDER):
        state.step = 41
        state.commit()
        with torch.no_grad():  # a half-done step after the commit: the sync rolls it back
            model.weight.add_(1.0)
    receivers = [r for r in range(world) if r not in (CHAIN_SOURCE, BYSTANDER)]
    moved = state.sync(CHAIN_SOURCE, timeout=datetime.timedelta(seconds=30),
                       receivers=receivers)
    fingerprint = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                   "step": state.step, "version": state.version}
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([moved]))  # the group's next collective
    return fingerprint, moved, [int(c.item()) for c in counts], _refuse_garbage(rank, receivers)


def _refuse_garbage(rank: int, receivers: list[int]) -> str:
    """The source sends bytes that are no skeleton: every receiver of the chain refuses them."""
    from elastic.state.errors import PayloadFormatError
    from elastic.state.feed import LENGTH_TAG, SKELETON_TAG
    if rank == CHAIN_SOURCE:
        garbage = b"\x80\x04not json at all"
        dist.send(torch.tensor([len(garbage)]), receivers[0], tag=LENGTH_TAG)
        dist.send(torch.frombuffer(bytearray(garbage), dtype=torch.uint8), receivers[0],
                  tag=SKELETON_TAG)
        return "sent"
    try:
        fed = feed_payload(None, CHAIN_SOURCE, receivers, timeout=datetime.timedelta(seconds=30))
    except PayloadFormatError as exc:
        return str(exc)
    return "took no part" if fed.nbytes == 0 else "accepted"


@pytest.mark.timeout(150)
def test_the_commit_reaches_every_receiver_along_the_chain_and_a_holder_moves_nothing(tmp_path):
    got = run_in_group(_feed_along_a_chain, 4, tmp_path)
    source = got[CHAIN_SOURCE][0]
    assert source["step"] == 41 and source["version"] == 2
    for rank in range(4):
        assert_same_tree(source, got[rank][0], f"rank {rank}")
    assert got[BYSTANDER][1] == 0, "a rank holding the source's commit moved state"
    weight_bytes = 300 * 200 * 4
    assert all(got[r][1] > weight_bytes for r in (0, 2, 3)), [got[r][1] for r in range(4)]
    assert got[0][2] == [got[r][1] for r in range(4)]
    assert got[BYSTANDER][3] == "took no part"
    for rank in (0, 3):  # rank 3 heard it from rank 0, which forwarded before it judged
        assert "sent a state skeleton that is not one" in got[rank][3], got[rank][3]
