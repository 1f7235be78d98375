"""``state.ddp`` skips DDP's broadcast of the parameters only when every rank holds them alike
already, as after a formation.

The digest is tested in-process; what DDP then does is tested in real gloo groups: a skipped
broadcast writes nothing into the parameters (their version counters stay), a kept one makes
every rank hold rank 0's values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic.ddp_sync import digest
from elastic.loop_helpers import ddp
from tests.support.gloo_group import run_in_group

CPU = torch.device("cpu")


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g),
            torch.arange(5), torch.ones(2, dtype=torch.bool)]


@pytest.mark.unit
def test_equal_tensors_have_equal_digests_and_any_difference_changes_it():
    base = digest(_tensors(), CPU)
    assert torch.equal(base, digest([t.clone() for t in _tensors()], CPU))
    one_element = _tensors()
    one_element[0][1, 2] += 1e-6
    swapped = _tensors()
    swapped[0][0], swapped[0][1] = swapped[0][1].clone(), swapped[0][0].clone()
    reordered = _tensors()
    reordered[0], reordered[1] = reordered[1], reordered[0]
    trainable = _tensors()
    trainable[0].requires_grad_(True)
    longer = _tensors() + [torch.zeros(1)]
    for changed in (one_element, reordered, trainable, longer):
        assert not torch.equal(base, digest(changed, CPU))
    # rows swapped inside one tensor keep its sums: the digest is a check against the
    # differences a job meets (another init, a write on one rank, drift), not an adversary
    assert torch.equal(base, digest(swapped, CPU))


@pytest.mark.unit
@pytest.mark.parametrize("odd", ["sparse", "meta"])
def test_a_tensor_with_no_plain_memory_to_read_makes_the_digest_say_so(odd: str):
    tensor = {"sparse": lambda: torch.ones(3).to_sparse(),
              "meta": lambda: torch.ones(2, device="meta")}[odd]()
    got = digest(_tensors() + [tensor], CPU)
    assert got[0] == 1 and not got[1:].any()


@pytest.mark.unit
def test_the_digest_reads_every_dtype_and_layout_of_a_plain_tensor_bit_for_bit():
    odd = [torch.ones(3, dtype=torch.cfloat), torch.tensor([float("nan"), float("inf")]),
           torch.randn(3, 5)[:, 1:4], torch.ones(3, dtype=torch.bfloat16)]
    assert torch.equal(digest(odd, CPU), digest([t.clone() for t in odd], CPU))
    changed = [t.clone() for t in odd]
    changed[3][0] = torch.nextafter(changed[3][0], torch.tensor(2.0, dtype=torch.bfloat16))
    assert not torch.equal(digest(odd, CPU), digest(changed, CPU))


def _ddp_of(rank: int, world: int, case: str) -> dict:
    torch.manual_seed(0)  # every rank builds the same model
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    if case == "one rank wrote through .data" and rank == 1:
        model[0].weight.data.add_(1.0)  # invisible to the tensor's version counter
    if case == "one rank's buffer differs" and rank == 1:
        model[1].running_mean.add_(1.0)
    versions = [p._version for p in model.parameters()]
    wrapped = ddp(model)
    return {"written": [p._version for p in model.parameters()] != versions,
            "weight": model[0].weight.detach().flatten().tolist(),
            "buffer": model[1].running_mean.tolist(), "module": wrapped.module is model}


def test_ddp_of_a_model_every_rank_holds_alike_writes_nothing_into_it(tmp_path: Path):
    results = run_in_group(_ddp_of, 2, tmp_path, "alike")
    assert all(r["module"] for r in results.values())
    assert [r["written"] for r in results.values()] == [False, False]
    (tmp_path / "torch's").mkdir()
    kept = run_in_group(_ddp_of_with_init_sync, 2, tmp_path / "torch's")
    assert kept[1], "torch's own broadcast does write: the check above can fail"


def _ddp_of_with_init_sync(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    versions = [p._version for p in model.parameters()]
    ddp(model, init_sync=True)
    return [p._version for p in model.parameters()] != versions


@pytest.mark.parametrize("case", ["one rank wrote through .data", "one rank's buffer differs"])
def test_ddp_of_a_model_that_differs_on_one_rank_makes_every_rank_hold_rank_0s(
        tmp_path: Path, case: str):
    results = run_in_group(_ddp_of, 2, tmp_path, case)
    assert results[0]["weight"] == results[1]["weight"]
    assert results[0]["buffer"] == results[1]["buffer"]
