"""elastic-trainer: data-parallel PyTorch training that survives workers leaving and joining.

Public names: ``ElasticState``, ``ElasticSampler``, ``TrainState``, ``CheckpointStore`` and the
typed errors. Importing this package starts nothing and imports neither torch nor the etcd
client: each public name is loaded on first use, so ``elastic --help`` stays fast.

The packages under this namespace, one per layer (imports point down only):

- ``elastic.launch``: the ``elastic`` CLI, the per-node launcher, plain-DDP mode, embedded etcd.
- ``elastic`` itself: ``ElasticState`` and its run loop, where the layers meet.
- ``elastic.cluster``: etcd membership, rendezvous, process groups, failure detection.
- ``elastic.state``: what is committed and how it moves (source folder ``state/``).
- ``elastic.checkpoint``: durable checkpoints on fsspec (source folder ``checkpoint/``).
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "AdvertiseAddressError": "elastic.errors",
    "CheckpointError": "elastic.checkpoint.errors",
    "CheckpointStore": "elastic.checkpoint",
    "DeviceUnavailableError": "elastic.errors",
    "ElasticError": "elastic.errors",
    "ElasticInterrupt": "elastic.errors",
    "ElasticSampler": "elastic.state",
    "ElasticState": "elastic.elastic_state",
    "EtcdRecordError": "elastic.errors",
    "EtcdUnavailableError": "elastic.errors",
    "FencedError": "elastic.errors",
    "LeaveInterrupt": "elastic.errors",
    "LinearLRScaling": "elastic.state",
    "MembershipChangedInterrupt": "elastic.errors",
    "PeerFailureError": "elastic.errors",
    "RNGState": "elastic.state",
    "RendezvousClosedError": "elastic.errors",
    "RendezvousTimeoutError": "elastic.errors",
    "SeededDataset": "elastic.state",
    "SqrtLRScaling": "elastic.state",
    "StateError": "elastic.state",
    "Timeouts": "elastic.timeouts",
    "TrainState": "elastic.state",
    "seed_everything": "elastic.state",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later reads are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
