"""The ``DeviceMesh`` of a sharded job's round: its shape for the round's world and shard degree,
and the mesh itself, built fresh at every formation with its subgroups connected.

A round's mesh has the round's ranks and nothing of an earlier round's: torch caches sharding
plans by mesh equality, so those caches are cleared before it is built (``forget_meshes``), and
its subgroups' connections join the round's ``ProcessGroup``, released and watched with it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastic.cluster.links.process_group import ProcessGroup
from elastic.cluster.rounds.places import shard_count
from elastic.state.sharded.shards import forget_meshes


def mesh_layout(world: int, shard_degree: int | None) -> tuple[int, ...]:
    """The mesh shape of a round: ``(world,)`` for FSDP; ``(world // S, S)`` for HSDP when the
    world is a multiple of ``S = shard_degree``, else ``(world,)`` (FSDP over every rank, with
    buddy copies, until the world is a multiple again). Rank ``r`` holds shard ``r % S`` of
    ``shard_count`` (the rule the rendezvous places members by)."""
    shards = shard_count(world, shard_degree)
    return (world,) if shards == world else (world // shards, shards)


def round_mesh(shape: tuple[int, ...], group: ProcessGroup) -> DeviceMesh:
    """The round's mesh of ``shape``, its subgroups connected and adopted by ``group``."""
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    before = group.sockets_now()
    forget_meshes()  # equal meshes of earlier rounds must not be found in torch's caches
    mesh = init_device_mesh(device, shape, mesh_dim_names=names)
    if len(shape) > 1:
        for dim in names:  # gloo connects lazily: a collective on each subgroup
            dist.barrier(group=mesh.get_group(dim))
    group.adopt(before)
    return mesh
