"""Loads a sharded checkpoint of ours with plain ``torch.distributed.checkpoint.load``: no
``elastic`` import anywhere. Run as a script: ``plain_dcp_load.py CKPT_DIR REFERENCE WORLD``;
it spawns WORLD gloo ranks, compares every tensor with the reference and exits 0 when all are
equal (printing how many it compared).
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_model  # noqa: E402  (a plain module next to this script: no package, no elastic)


def _rank(rank: int, world: int, ckpt_dir: str, reference: str, store: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    _load_and_compare(rank, world, ckpt_dir, reference)
    # The model's mesh and FSDP state hold the groups: freed here, not at the interpreter's
    # exit, where a gloo rank once aborted ("terminate called without an active exception").
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _load_and_compare(rank: int, world: int, ckpt_dir: str, reference: str) -> None:
    model, opt = fsdp_model.build(world, seed=1)
    state = fsdp_model.sharded_state(model, opt)
    dcp.load(state, checkpoint_id=ckpt_dir)
    fsdp_model.apply(model, opt, state)
    full = fsdp_model.full_state(model, opt)
    if rank == 0:
        assert not [m for m in sys.modules if m == "elastic" or m.startswith("elastic.")]
        expected = torch.load(reference, weights_only=True)
        wrong = fsdp_model.differences(expected, full)
        assert not wrong, wrong
        print(f"equal: {fsdp_model.count(expected)} tensors", flush=True)


if __name__ == "__main__":
    ckpt, ref, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(size, ckpt, ref, os.path.join(tmp, "store")), nprocs=size)
