"""TrainState.sync over a real gloo group of 3 or 4 spawned processes (FileStore, loopback)."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.state import ElasticSampler, NoCommitError, TrainState
from elastic.state.errors import SyncError
from elastic.state.feed import Packing, feed_payload, plan_pieces
from elastic.state.sync import TensorSlot, newest_source, plan_buckets
from elastic.state.wire import encode
from tests.support.gloo_group import run_in_group
from tests.support.polling import poll_until
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


def test_a_slot_lands_only_in_a_contiguous_tensor_of_its_path_shape_and_dtype_once():
    from elastic.state.sync import landing_tensors
    from elastic.state.wire import decode
    tied = torch.zeros(4, 5)
    payload = {"w": torch.ones(4, 5), "t": torch.ones(4, 5), "shape": torch.ones(4, 5),
               "dtype": torch.ones(4, 5), "strided": torch.ones(4, 5), "z": torch.ones(0),
               "s": [torch.ones(3)], "absent": torch.ones(2)}
    into = {"w": tied, "t": tied, "shape": torch.zeros(5, 4), "dtype": torch.zeros(4, 5).double(),
            "strided": torch.zeros(5, 4).t(), "z": torch.zeros(0),
            "s": [nn.Parameter(torch.zeros(3))]}
    skeleton = decode(encode(payload, []))
    landed = landing_tensors(skeleton, into, torch.device("cpu"))
    names = list(payload)
    assert {names[i] for i in landed} == {"w", "s"}, "tied weights land once; misfits never"
    assert landed[0].data_ptr() == tied.data_ptr()
    assert landed[6].data_ptr() == into["s"][0].data_ptr()
    assert not landed[6].requires_grad


def _land_in_own_tensors(rank: int, world: int) -> tuple[dict, dict, bool]:
    """Rank 0 trains; rank 1 joined (a commit, empty Adam state); rank 2 trained apart."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(600, 500), nn.Linear(500, 2))  # a 1.2 MB weight: alone
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = TrainState(model=model, optimizer=opt, epoch=rank)
    for _ in range(2 if rank != 1 else 0):
        opt.zero_grad()
        model(torch.randn(8, 600)).sum().backward()
        opt.step()
    state.commit()
    weight = model[0].weight.data_ptr()
    moment = opt.state[model[0].weight]["exp_avg"].data_ptr() if rank == 2 else None
    state.sync(0, timeout=datetime.timedelta(seconds=30), receivers=[1, 2])
    landed = (model[0].weight.data_ptr() == weight and
              (rank != 2 or opt.state[model[0].weight]["exp_avg"].data_ptr() == moment))
    synced = _fingerprint_of(state)
    opt.zero_grad()  # a step after the sync, then a rollback to the synced commit
    model(torch.randn(8, 600)).sum().backward()
    opt.step()
    state.restore()
    return synced, _fingerprint_of(state), landed


def _fingerprint_of(state: TrainState) -> dict:
    from elastic.state.stateful import snapshot
    return snapshot({"model": state.model.state_dict(), "epoch": state.epoch,
                     "optimizer": state.optimizer.state_dict(), "version": state.version})


@pytest.mark.timeout(150)
def test_receivers_take_the_state_into_their_own_tensors_and_commit_a_copy_apart(tmp_path):
    got = run_in_group(_land_in_own_tensors, 3, tmp_path)
    source = got[0][0]
    assert source["optimizer"]["state"] and source["epoch"] == 0
    for rank in range(3):
        assert_same_tree(source, got[rank][0], f"rank {rank} synced")
        assert_same_tree(source, got[rank][1], f"rank {rank} rolled back after a step")
        assert got[rank][2], f"rank {rank}: the state did not land in its own tensors"


class _Consuming:
    """A Stateful whose ``load_state_dict`` takes its entries out of the dict it is given."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state_dict: dict) -> None:
        self.n = state_dict.pop("n")


def _sync_into_a_stateful_that_consumes_its_dict(rank: int, world: int) -> tuple[int, int]:
    state = TrainState(model=nn.Linear(64, 64), counter=_Consuming(10 + rank))
    state.commit()
    if rank == 0:
        state.commit()  # the newer commit: rank 1 receives it
    state.sync(0, timeout=datetime.timedelta(seconds=30))
    state.counter.n = -1
    state.restore()  # the commit holds what came, whatever load_state_dict did to its dict
    return state.counter.n, state.version


def test_a_received_commit_stays_whole_when_a_stateful_consumes_the_dict_it_loads(tmp_path):
    assert run_in_group(_sync_into_a_stateful_that_consumes_its_dict, 2, tmp_path) \
        == {0: (10, 2), 1: (10, 2)}


def _sync_cut_off_after_the_first_piece(rank: int, world: int, marker: str) -> dict:
    import elastic.state.feed as feed  # noqa: PLC0415 (the source's own fault, below)
    torch.manual_seed(rank)
    state = TrainState(model=nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)))
    state.commit()
    if rank == 0:  # the newer commit; its source stops sending after the first piece
        state.commit()
        real_start, sent = feed._start, []

        def start(piece, number, sources, link):
            if number:  # once the first piece is out
                for work in sent[0].forwards:
                    work.wait()
                raise RuntimeError("the source is gone")
            sent.append(piece)
            return real_start(piece, number, sources, link)
        feed._start = start
        with pytest.raises(RuntimeError, match="the source is gone"):
            state.sync(0)
        assert poll_until(lambda: Path(marker).exists(), 60), "the receiver never gave up"
        return {"unsettled": state.unsettled}
    own = {k: v.clone() for k, v in state.model.state_dict().items()}
    with pytest.raises(SyncError):
        state.sync(0, timeout=datetime.timedelta(seconds=3))
    Path(marker).touch()
    changed = [k for k, v in state.model.state_dict().items() if not torch.equal(v, own[k])]
    unsettled = state.unsettled
    state.restore()
    kept = all(torch.equal(v, own[k]) for k, v in state.model.state_dict().items())
    return {"changed": changed, "unsettled": unsettled, "kept": kept,
            "after": state.unsettled}


def test_a_transfer_cut_off_half_way_leaves_the_receiver_unsettled_until_it_restores(tmp_path):
    got = run_in_group(_sync_cut_off_after_the_first_piece, 2, tmp_path,
                       str(tmp_path / "receiver-gave-up"))
    assert got[0] == {"unsettled": False}
    receiver = got[1]
    assert receiver["changed"] and receiver["unsettled"], receiver  # part of rank 0's landed
    assert receiver["kept"] and not receiver["after"], receiver
