"""A mesh of a new round must not pick up torch's DTensor caches of an equal mesh of an earlier
round: there this rank sat elsewhere, in process groups that are gone."""

from __future__ import annotations

import datetime

import pytest
import torch

from tests.support.gloo_group import run_in_group

pytestmark = pytest.mark.unit


def _two_rounds(rank: int, world: int, store_dir: str, forget: bool) -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from elastic.state.sharded.shards import forget_meshes

    def full_of_a_shard(mesh) -> torch.Tensor:
        whole = torch.arange(8.0).reshape(4, 2)
        sharded = distribute_tensor(whole, mesh, [Shard(0), Shard(0)][: mesh.ndim])
        return (sharded * 2).full_tensor()  # an op (cached sharding) and a redistribution

    full_of_a_shard(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    dist.destroy_process_group()
    # the next round: the same world, every rank in another place of the mesh
    store = dist.FileStore(f"{store_dir}/round-2", world)
    dist.init_process_group("gloo", store=store, rank=world - 1 - rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    if forget:
        forget_meshes()
    try:
        full = full_of_a_shard(init_device_mesh("cpu", (2, 2),
                                                mesh_dim_names=("replicate", "shard")))
    except RuntimeError as exc:
        return str(exc)
    return "ok" if torch.equal(full, torch.arange(8.0).reshape(4, 2) * 2) else "wrong"


def test_a_new_rounds_mesh_works_once_the_caches_of_an_equal_earlier_mesh_are_forgotten(
        tmp_path):
    results = run_in_group(_two_rounds, 4, tmp_path, str(tmp_path), True)
    assert set(results.values()) == {"ok"}
