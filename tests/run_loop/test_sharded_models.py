"""Which ranks of a sharded job built another model (``elastic/sharded_models.py``): the verdict
on the gathered digests, and the text a model is described by."""

from __future__ import annotations

import pytest

from elastic.foundation.errors import PeerFailureError
from elastic.sharded_models import _difference, _model_only, _read, decide
from elastic.state.sharded.layout import TensorSpec

pytestmark = pytest.mark.unit

SPECS = {"model/a.weight": TensorSpec(13, 56), "model/a.bias": TensorSpec(13, 8),
         "optim/a.weight/exp_avg": TensorSpec(13, 56), "optim/a.weight/step": TensorSpec(
             1, 8, sharded=False)}


def test_a_joiner_unlike_the_commit_is_the_one_wrong_even_where_it_would_be_a_majority():
    # ranks 0 and 1 hold the commit (digest 7); three joiners built 9: the commit decides
    verdict = decide([(7, 7), (7, 7), (9, -1), (9, -1), (9, -1)])
    assert verdict.committed and verdict.want == 7 and verdict.wrong == [2, 3, 4]
    assert verdict.source == 0 and not verdict.tie


def test_a_holder_whose_own_model_differs_from_its_commit_is_wrong_too():
    assert decide([(7, 7), (8, 7), (7, -1)]).wrong == [1]


def test_without_a_commit_the_model_most_ranks_built_is_the_jobs():
    verdict = decide([(9, -1), (7, -1), (7, -1)])
    assert not verdict.committed and verdict.want == 7 and verdict.wrong == [0]
    assert verdict.source == 1 and not verdict.tie


def test_two_models_built_by_as_many_ranks_each_are_a_tie():
    assert decide([(7, -1), (9, -1), (9, -1), (7, -1)]).tie


def test_ranks_that_all_agree_leave_no_one_wrong():
    assert decide([(7, 7), (7, -1)]).wrong == []
    assert decide([(5, -1), (5, -1)]).wrong == []


def test_a_model_described_as_data_reads_back_without_its_optimizer_entries():
    told = {n: [s.rows, s.row_bytes, int(s.sharded)] for n, s in _model_only(SPECS).items()}
    back = _read(told)
    assert back == {"model/a.bias": TensorSpec(13, 8), "model/a.weight": TensorSpec(13, 56)}


def test_the_difference_names_the_first_tensor_that_differs_in_words():
    wider = {**SPECS, "model/a.bias": TensorSpec(14, 8)}
    assert _difference(wider, SPECS) == ("model/a.bias has 14 rows of 8 bytes here, 13 of 8 "
                                         "in the job's model")
    fewer = {k: v for k, v in SPECS.items() if k != "model/a.bias"}
    assert _difference(fewer, SPECS) == "model/a.bias is in the job's model, not in this one"


def test_a_malformed_description_from_a_peer_is_a_peer_failure_not_a_crash():
    with pytest.raises(PeerFailureError, match="malformed"):
        _read({"model/a.weight": ["thirteen", 56, 1]})
    with pytest.raises(PeerFailureError, match="malformed"):
        _read(["model/a.weight", 13, 56, 1])
