"""Durable sharded checkpoints: written by every rank of a real FSDP2 job (gloo, CPU, float64),
loaded at other world sizes with every parameter and Adam moment equal, readable by plain
``torch.distributed.checkpoint.load``, never listed when torn, refused when corrupt."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic.checkpoint import (CheckpointCorruptError, CheckpointIncompatibleError,
                                CheckpointStore)
from tests.support.gloo_group import run_in_group
from tests.support.rank_processes import rank_context
from tests.workers import sharded_checkpoints as workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
LOADED = 300  # s: a loaded machine starts and stops torch processes slowly
WORKERS = Path(workers.__file__).parent


@pytest.fixture(scope="module")
def written_at_4(tmp_path_factory) -> tuple[str, str]:
    """A sharded checkpoint written by 4 ranks after 3 steps, and the full state it holds."""
    root = tmp_path_factory.mktemp("sharded")
    url, reference = str(root / "ckpt"), str(root / "reference.pt")
    steps = run_in_group(workers.write, 4, root, url, reference, timeout_s=LOADED)
    assert set(steps.values()) == {3}
    return url, reference


@pytest.mark.parametrize("world", [3, 2, 5])
def test_a_checkpoint_written_at_4_ranks_loads_equal_at_another_world_size(
        written_at_4, tmp_path, world):
    url, reference = written_at_4
    results = run_in_group(workers.load_and_compare, world, tmp_path, url, reference,
                           timeout_s=LOADED)
    wrong, compared = results[0]
    assert compared == 3 * 2 + 3 * 2 * 3  # 3 layers x (weight, bias) x (param, step, 2 moments)
    assert wrong == []


def test_a_sharded_checkpoint_loads_with_plain_torch_dcp_and_no_elastic_import(written_at_4):
    url, reference = written_at_4
    done = subprocess.run([sys.executable, str(WORKERS / "plain_dcp_load.py"),
                           f"{url}/000000000003", reference, "3"],
                          capture_output=True, text=True, timeout=LOADED)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "equal: 24 tensors" in done.stdout


def test_the_manifest_lists_every_rank_file_with_its_checksum(written_at_4):
    url, _ = written_at_4
    ref = CheckpointStore(url).latest()
    assert ref.manifest.payload_format == "torch.distributed.checkpoint"
    on_disk = sorted(p.name for p in Path(url, "000000000003").iterdir())
    assert sorted(ref.manifest.files) == [n for n in on_disk if n != "manifest.json"]
    assert {".metadata", "__0_0.distcp", "__3_0.distcp", "state.pt"} <= set(ref.manifest.files)
    with pytest.raises(CheckpointIncompatibleError, match="is sharded"):
        CheckpointStore(url).load()


def test_a_flipped_byte_in_a_shard_is_refused_and_the_load_falls_back_to_the_one_before(
        tmp_path):
    got = run_in_group(workers.corrupt_then_load, 1, tmp_path, str(tmp_path / "ckpt"),
                       timeout_s=LOADED)[0]
    assert "__0_0.distcp" in got["named"] and "does not match its manifest" in got["named"]
    assert got["fallback"] == 1 and got["wrong"] == []


def test_a_step_rewritten_over_a_torn_try_saves_without_dcps_overwrite_warning(tmp_path):
    got = run_in_group(workers.rewrite_a_torn_step, 1, tmp_path, str(tmp_path / "ckpt"),
                       timeout_s=LOADED)[0]
    assert not [w for w in got["warnings"] if "existing checkpoint" in w], got["warnings"]
    assert got["listed"] == [1, 2] and got["loaded"] == 2 and got["wrong"] == []


def test_a_rank_that_dies_before_the_manifest_leaves_no_listed_checkpoint(tmp_path):
    url = str(tmp_path / "ckpt")
    ctx = rank_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_of_torn_write, args=(rank, 2, tmp_path, url, results))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        rank, ok, body = results.get(timeout=LOADED)
        assert rank == 0 and ok, body
        got = torch.load(io.BytesIO(body), weights_only=False)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    assert procs[1].exitcode == 17  # it died where the fault was planted
    assert got["error"], "rank 0 carried on past a dead peer"
    assert got["listed"] == [1]
    assert "no manifest" in got["torn"][2]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(got["files"])


def _rank_of_torn_write(rank: int, world: int, tmp: Path, url: str, results) -> None:
    from tests.support import gloo_group  # noqa: PLC0415  (imported in the rank process)
    gloo_group._child(workers.die_before_the_manifest, rank, world,
                      str(tmp / "gloo-file-store"), (url,), results)


def test_a_crafted_dcp_index_is_refused_unrun_and_the_load_falls_back_to_the_one_before(
        tmp_path):
    got = run_in_group(workers.crafted_index_then_load, 1, tmp_path, str(tmp_path / "ckpt"),
                       timeout_s=LOADED)[0]
    assert got == {"code_ran": False, "loaded": 1}
