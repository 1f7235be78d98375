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
    "AdvertiseAddressError": "elastic.foundation.errors",
    "CheckpointError": "elastic.checkpoint.errors",
    "CheckpointBackendError": "elastic.checkpoint.errors",
    "CheckpointCorruptError": "elastic.checkpoint.errors",
    "CheckpointCredentialsError": "elastic.checkpoint.errors",
    "CheckpointFencedError": "elastic.checkpoint.errors",
    "CheckpointHeldError": "elastic.checkpoint.errors",
    "CheckpointIncompatibleError": "elastic.checkpoint.errors",
    "CheckpointLocationError": "elastic.checkpoint.errors",
    "CheckpointNotFoundError": "elastic.checkpoint.errors",
    "CheckpointRaceError": "elastic.checkpoint.errors",
    "CheckpointReadError": "elastic.checkpoint.errors",
    "CheckpointStorageError": "elastic.checkpoint.errors",
    "CheckpointUnsafeError": "elastic.checkpoint.errors",
    "CheckpointWriteError": "elastic.checkpoint.errors",
    "CheckpointResumeError": "elastic.foundation.errors",
    "CheckpointUnusableError": "elastic.foundation.errors",
    "DurableCommitsFailedError": "elastic.foundation.errors",
    "EtcdAccessError": "elastic.foundation.errors",
    "NothingTrainedError": "elastic.foundation.errors",
    "SetupError": "elastic.foundation.errors",
    "ShardedModelError": "elastic.sharded_models",
    "ShardedStateLostError": "elastic.sharded",
    "UnfinishedWriteError": "elastic.foundation.errors",
    "CheckpointStore": "elastic.checkpoint",
    "DeviceUnavailableError": "elastic.foundation.errors",
    "ElasticError": "elastic.foundation.errors",
    "ElasticInterrupt": "elastic.foundation.errors",
    "ElasticSampler": "elastic.state",
    "ElasticState": "elastic.elastic_state",
    "EtcdRecordError": "elastic.foundation.errors",
    "EtcdUnavailableError": "elastic.foundation.errors",
    "FencedError": "elastic.foundation.errors",
    "FencingContestedError": "elastic.foundation.errors",
    "LeaveInterrupt": "elastic.foundation.errors",
    "LinearLRScaling": "elastic.state",
    "MembershipChangedInterrupt": "elastic.foundation.errors",
    "PeerFailureError": "elastic.foundation.errors",
    "RNGState": "elastic.state",
    "RendezvousClosedError": "elastic.foundation.errors",
    "RendezvousTimeoutError": "elastic.foundation.errors",
    "SeededDataset": "elastic.state",
    "SqrtLRScaling": "elastic.state",
    "StateError": "elastic.state",
    "Timeouts": "elastic.foundation.timeouts",
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
