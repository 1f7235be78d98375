"""Rank functions of the sharded checkpoint tests (run by ``tests.support.gloo_group``)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from elastic.checkpoint import CheckpointCorruptError, CheckpointStore
from elastic.checkpoint import sharded as sharded_module
from elastic.checkpoint.sharded import ShardedCheckpoints
from tests.workers import fsdp_model


def write(rank: int, world: int, url: str, reference: str, step: int = 3) -> int:
    """Trains ``step`` steps at ``world`` ranks, saves a sharded checkpoint; rank 0 keeps the
    full state in ``reference`` for the loaders to compare with."""
    model, opt = fsdp_model.build(world, seed=0)
    fsdp_model.train(model, opt, rank, step)
    ref = ShardedCheckpoints(CheckpointStore(url)).save(
        step, fsdp_model.sharded_state(model, opt), {"epoch": 1, "note": "sharded"},
        payload={"step": step, "seen": torch.arange(rank, rank + 3)})
    full = fsdp_model.full_state(model, opt)
    if rank == 0:
        torch.save(full, reference)
    return ref.step


def load_and_compare(rank: int, world: int, url: str, reference: str) -> tuple[list[str], int]:
    """Builds the model at ``world`` ranks from another seed, loads the newest sharded
    checkpoint into it; rank 0 returns what differs from the reference and how much it checked."""
    model, opt = fsdp_model.build(world, seed=1)
    state = fsdp_model.sharded_state(model, opt)
    loaded = ShardedCheckpoints(CheckpointStore(url)).load(state)
    assert loaded.metadata["note"] == "sharded" and loaded.ref.world_size == 4, loaded.metadata
    assert loaded.state_dict["step"] == 3  # rank 0's payload, on every rank
    assert torch.equal(loaded.state_dict["seen"], torch.arange(3))
    fsdp_model.apply(model, opt, state)
    full = fsdp_model.full_state(model, opt)
    if rank != 0:
        return [], 0
    expected = torch.load(reference, weights_only=True)
    return fsdp_model.differences(expected, full), fsdp_model.count(expected)


def die_before_the_manifest(rank: int, world: int, url: str) -> dict[str, Any]:
    """Saves step 1, then step 2 during which rank 1 dies once its shards are written (while
    the ranks read them back); rank 0 reports the error it got and what the store lists."""
    model, opt = fsdp_model.build(world, seed=0)
    fsdp_model.train(model, opt, rank, 1)
    store = CheckpointStore(url)
    shards = ShardedCheckpoints(store)
    shards.save(1, fsdp_model.sharded_state(model, opt))
    if rank == 1:
        def dying(storage: Any, path: str) -> Any:
            os._exit(17)  # a rank killed after writing its shards, before the manifest
        sharded_module.file_entry = dying
    try:
        shards.save(2, fsdp_model.sharded_state(model, opt))
    except RuntimeError as exc:  # the collective that lost its peer
        error = repr(exc)
    else:
        error = ""
    scan = store.scan()
    return {"error": error, "listed": [r.step for r in scan.valid], "torn": dict(scan.invalid),
            "files": sorted(os.listdir(url + "/000000000002")) if os.path.isdir(url + "/000000000002") else []}


def rewrite_a_torn_step(rank: int, world: int, url: str) -> dict[str, Any]:
    """Saves step 1; leaves step 2's directory as a try that crashed before its manifest (DCP's
    files, ``.metadata`` among them), then saves step 2 again: the warnings that save gave,
    what the store lists and whether step 2 loads equal."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    model, opt = fsdp_model.build(world, seed=0)
    store = CheckpointStore(url)
    shards = ShardedCheckpoints(store)
    fsdp_model.train(model, opt, rank, 1)
    shards.save(1, fsdp_model.sharded_state(model, opt))
    fsdp_model.train(model, opt, rank, 1)
    dcp.save(fsdp_model.sharded_state(model, opt), checkpoint_id=os.path.join(url, "000000000002"))
    at_2 = fsdp_model.full_state(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shards.save(2, fsdp_model.sharded_state(model, opt))
    state = fsdp_model.sharded_state(model, opt)
    loaded = shards.load(state)
    fsdp_model.apply(model, opt, state)
    return {"warnings": [str(w.message) for w in caught], "listed": [r.step for r in store.list()],
            "loaded": loaded.ref.step,
            "wrong": fsdp_model.differences(at_2, fsdp_model.full_state(model, opt))}


def corrupt_then_load(rank: int, world: int, url: str) -> dict[str, Any]:
    """Saves steps 1 and 2, flips one byte of a shard file of step 2, then loads: step 2 by
    name, and the newest that verifies."""
    model, opt = fsdp_model.build(world, seed=0)
    shards = ShardedCheckpoints(CheckpointStore(url))
    fsdp_model.train(model, opt, rank, 1)
    shards.save(1, fsdp_model.sharded_state(model, opt))
    at_1 = fsdp_model.full_state(model, opt)
    fsdp_model.train(model, opt, rank, 1)
    newest = shards.save(2, fsdp_model.sharded_state(model, opt))
    shard = os.path.join(url, "000000000002", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    state = fsdp_model.sharded_state(model, opt)
    try:
        shards.load(state, newest)
        named = ""
    except CheckpointCorruptError as exc:
        named = str(exc)
    fallback = shards.load(state)
    fsdp_model.apply(model, opt, state)
    return {"named": named, "fallback": fallback.ref.step,
            "wrong": fsdp_model.differences(at_1, fsdp_model.full_state(model, opt))}


class _Crafted:
    """What a crafted ``.metadata`` holds: a call of a function when it is unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return os.rename, (self.marker + ".absent", self.marker)  # any call: this one, harmless


def crafted_index_then_load(rank: int, world: int, url: str) -> dict[str, Any]:
    """Saves steps 1 and 2; a writer of the URL replaces step 2's DCP index with a pickle that
    calls a function (a file renamed), and its manifest's entry to match; then loads."""
    import hashlib
    import json
    import pickle

    model, opt = fsdp_model.build(world, seed=0)
    shards = ShardedCheckpoints(CheckpointStore(url))
    for step in (1, 2):
        fsdp_model.train(model, opt, rank, 1)
        shards.save(step, fsdp_model.sharded_state(model, opt))
    marker = os.path.join(url, "code-ran")
    open(marker + ".absent", "w").close()
    crafted = pickle.dumps(_Crafted(marker))
    step_dir = os.path.join(url, "000000000002")
    with open(os.path.join(step_dir, ".metadata"), "wb") as f:
        f.write(crafted)
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["files"][".metadata"] = {"size": len(crafted),
                                      "sha256": hashlib.sha256(crafted).hexdigest()}
    with open(os.path.join(step_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with warnings.catch_warnings(record=True):
        loaded = shards.load(fsdp_model.sharded_state(model, opt))
    return {"code_ran": os.path.exists(marker), "loaded": loaded.ref.step}
