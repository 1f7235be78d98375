"""One rank's shards of a sharded model and its optimizer, as flat named tensors.

``torch.distributed.checkpoint.state_dict.get_state_dict`` gives the model's parameters and
the optimizer's state as DTensors (FSDP2 ``Shard(0)`` on the shard dimension of the mesh) and
plain tensors (Adam's ``step``: the same on every rank). Owns naming them flat
(``model/<fqn>``, ``optim/<fqn>/<key>``), copying this rank's local parts to recycled host
memory (pinned when they live on a GPU) with each tensor's ``TensorSpec``, and writing local parts
back into the objects of a new formation (``load_local``; or in place, where
``hold_every_tensor`` finds that the local parts are the objects' own). Torch only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard

from elastic.state.device_copy import copy_to_host
from elastic.state.errors import StateError
from elastic.state.sharded.buffers import HostShard, ShardBuffers, carve, shapes_of
from elastic.state.sharded.layout import TensorSpec

MODEL, OPTIM = "model/", "optim/"


class ShardLayoutError(StateError):
    """A sharded tensor is not sharded the way FSDP2 shards (``Shard(0)`` on one mesh
    dimension, replicated on the others)."""


def forget_meshes() -> None:
    """Clears torch's DTensor caches that are keyed by mesh equality.

    Two meshes of equal shape and names compare equal across formations, so a sharding or
    redistribution plan cached in an earlier round would hand a DTensor of this round the old
    mesh, whose process groups (and this rank's place in them) are gone: a collective then
    fails with "Could not resolve the process group registered under the name N". Call it
    before building a round's mesh.
    """
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._api import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    # what torch.distributed.tensor.debug._clear_sharding_prop_cache does, without importing
    # that package: it pulls in torch._inductor, seconds in a fresh process (a joiner's first
    # formation, which the survivors wait for)
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()


def sharded_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state dicts, sharded (DTensors), from torch's
    ``get_state_dict`` (optimizer state initialised when no step ran yet)."""
    return get_state_dict(model, optimizer)


def flat_tensors(model_sd: Mapping[str, Any], optim_sd: Mapping[str, Any]
                 ) -> dict[str, torch.Tensor]:
    """Every tensor of the two state dicts by flat name; the optimizer's param groups (plain
    values, the same on every rank) are left out."""
    flat = {MODEL + fqn: value for fqn, value in model_sd.items() if torch.is_tensor(value)}
    for fqn, entry in optim_sd.get("state", {}).items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                flat[f"{OPTIM}{fqn}/{key}"] = value
    return flat


def spec_of(value: torch.Tensor) -> TensorSpec:
    """The tensor's dim-0 rows and bytes per row; a plain tensor or 0-dim value is whole.

    Raises:
        ShardLayoutError: a DTensor sharded otherwise than on dim 0.
    """
    if not isinstance(value, DTensor):
        return TensorSpec(1, value.numel() * value.element_size(), sharded=False)
    shards = [p for p in value.placements if p.is_shard()]
    if len(shards) != 1 or shards[0] != Shard(0) or value.dim() == 0:
        raise ShardLayoutError(f"a DTensor placed {value.placements} is not sharded as FSDP2 "
                               "shards (Shard(0) on one mesh dimension); apply fully_shard only.")
    row = value.numel() // value.shape[0] if value.shape[0] else 0
    return TensorSpec(value.shape[0], row * value.element_size())


def local_part(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def hold_every_tensor(parts: Mapping[str, torch.Tensor], model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``parts`` (local parts) are the objects' own tensors and hold every parameter
    and optimizer state tensor of ``model`` and ``optimizer``, none created or replaced since
    they were taken: writing ``parts`` then writes the objects, all of them. A check by
    address, with no state dict taken."""
    now = [*model.parameters(), *(v for state in optimizer.state.values()
                                  for v in state.values() if isinstance(v, torch.Tensor))]
    owned = {local_part(t).data_ptr() for t in [*now, *model.buffers()]}
    recorded = {t.data_ptr() for t in parts.values()}
    return (all(local_part(t).data_ptr() in recorded for t in now)
            and all(t.data_ptr() in owned for t in parts.values() if t.numel()))


def host_copy(flat: Mapping[str, torch.Tensor], buffers: ShardBuffers | None = None
              ) -> HostShard:
    """This rank's local part of every tensor, copied to host memory taken from ``buffers``
    (default: new memory), pinned when a part lives on a GPU."""
    parts = {name: local_part(value).detach() for name, value in flat.items()}
    pinned = any(part.device.type == "cuda" for part in parts.values())
    shapes = shapes_of(parts)
    copies = buffers.take(shapes, pinned) if buffers is not None else carve(shapes, pinned)
    copy_to_host([(copies[name], part) for name, part in parts.items()])
    return copies


def load_local(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               model_sd: dict[str, Any], optim_sd: dict[str, Any],
               local: Mapping[str, torch.Tensor]) -> None:
    """Writes ``local`` (flat name -> this rank's part, on host) into the state dicts from
    ``sharded_state_dict`` and loads them with torch's ``set_state_dict``.

    Raises:
        ShardLayoutError: a local part's shape is not the one this rank's shard has.
    """
    flat = flat_tensors(model_sd, optim_sd)
    missing = sorted(set(flat) - set(local))
    if missing:
        raise ShardLayoutError(f"the resharded state lacks {missing[:3]}: the model built by "
                               "parallelize differs from the committed one.")
    with torch.no_grad():
        for name, value in flat.items():
            target = local_part(value)
            if target.shape != local[name].shape:
                raise ShardLayoutError(
                    f"{name}: this rank's shard is {tuple(target.shape)} but the reshard made "
                    f"{tuple(local[name].shape)}; the model built by parallelize differs from "
                    "the committed one.")
            target.copy_(local[name])
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
