"""state.batches / state.ddp / state.print's helpers, without a cluster: what they call when."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from elastic.loop_helpers import batch_length, batches, print_main
from elastic.state import ElasticSampler

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class Commits:
    def __init__(self) -> None:
        self.calls: list[bool] = []

    def __call__(self, durable: bool = False) -> None:
        self.calls.append(durable)


def loader(n: int = 10, batch_size: int = 2) -> DataLoader:
    dataset = TensorDataset(torch.arange(n).float(), torch.arange(n))
    return DataLoader(dataset, batch_size=batch_size, sampler=ElasticSampler(dataset, seed=0))


def test_batches_sets_the_epoch_records_each_batch_commits_every_n_and_durably_at_the_end():
    data, commits = loader(), Commits()
    seen = [len(x) for x, _ in batches(data, commits, epoch=3, commit_every=2,
                                       checkpoint_at_end=True)]
    assert seen == [2] * 5
    assert data.sampler.epoch == 3 and data.sampler.batches_done == 5
    assert commits.calls == [False, False, True]  # after batches 2 and 4, then durable


def test_a_loop_re_entered_at_the_end_of_its_epoch_neither_trains_nor_checkpoints_again():
    data, commits = loader(), Commits()
    list(batches(data, commits, epoch=0, checkpoint_at_end=True))
    again = Commits()
    assert list(batches(data, again, epoch=0, checkpoint_at_end=True)) == []
    assert again.calls == [], "nothing new to save: a resumed finished job must not look busy"


def test_a_batch_is_recorded_only_once_the_loop_body_asks_for_the_next():
    data, commits = loader(), Commits()
    iterator = batches(data, commits, epoch=0)
    next(iterator)
    assert data.sampler.batches_done == 0
    next(iterator)
    assert data.sampler.batches_done == 1


def test_batch_length_reads_the_first_tensor_and_says_what_to_do_without_one():
    assert batch_length(torch.zeros(7, 3)) == 7
    assert batch_length({"x": torch.zeros(4), "y": torch.zeros(4)}) == 4
    assert batch_length([(torch.zeros(5),), 1]) == 5
    with pytest.raises(TypeError, match="record_batch"):
        batch_length(["text"])
    with pytest.raises(ValueError, match="commit_every"):
        list(batches(loader(), Commits(), commit_every=0))


def test_print_main_prints_on_rank_zero_only(capsys):
    print_main(False, "not me")
    print_main(True, "me")
    assert capsys.readouterr().out == "me\n"


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_commit_step_in_the_body_of_batches_commits_the_batch_its_step_trained(accumulate):
    # batches() records a batch once the body is done with it; a commit_step() in the body
    # committed the step's update with the sampler before that batch, and every rollback to
    # it trained the batch again.
    from elastic import ElasticState
    data = loader(n=32, batch_size=4)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ElasticState(model=model, optimizer=opt, sampler=data.sampler, step=0)
    state.train_state.commit()
    for i, (x, _) in enumerate(state.batches(data)):
        model(x.unsqueeze(1)).pow(2).sum().backward()
        if (i + 1) % accumulate == 0:
            with state.commit_step():
                opt.step()
                opt.zero_grad()
                state.step += 1
        if i == 3:
            break  # the next step's collective fails: a rollback to the last commit
    state.train_state.restore()
    assert (state.step, data.sampler.batches_done, data.sampler.consumed) == (
        4 // accumulate, 4, 16)
