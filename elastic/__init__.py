"""elastic-trainer: data-parallel PyTorch training that survives workers leaving and joining.

Public names: ``ElasticState``, ``ElasticSampler``, ``TrainState``, ``CheckpointStore`` and the
typed errors. Importing this package starts nothing.
"""

from checkpoint import CheckpointStore
from checkpoint.errors import CheckpointError
from elastic.errors import (AdvertiseAddressError, ElasticError, ElasticInterrupt,
                            EtcdUnavailableError, FencedError, LeaveInterrupt,
                            MembershipChangedInterrupt, PeerFailureError, RendezvousClosedError,
                            RendezvousTimeoutError)
from elastic.runner import ElasticState
from state import (ElasticSampler, LinearLRScaling, RNGState, SeededDataset, SqrtLRScaling,
                   StateError, TrainState, seed_everything)

__all__ = [
    "AdvertiseAddressError", "CheckpointError", "CheckpointStore", "ElasticError",
    "ElasticInterrupt", "ElasticSampler", "ElasticState", "EtcdUnavailableError", "FencedError",
    "LeaveInterrupt", "LinearLRScaling", "MembershipChangedInterrupt", "PeerFailureError",
    "RNGState", "RendezvousClosedError", "RendezvousTimeoutError", "SeededDataset",
    "SqrtLRScaling", "StateError", "TrainState", "seed_everything",
]
