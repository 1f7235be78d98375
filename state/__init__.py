"""What is committed and how it moves: TrainState, ElasticSampler, Stateful helpers.

Knows torch and torch.distributed collectives; never imports ``elastic`` or ``checkpoint``.
"""

from state.errors import NoCommitError, StateError, StateKeyError, SyncError
from state.sampler import ElasticSampler
from state.stateful import Stateful, is_stateful, snapshot
from state.train_state import TrainState

__all__ = [
    "ElasticSampler",
    "NoCommitError",
    "StateError",
    "StateKeyError",
    "Stateful",
    "SyncError",
    "TrainState",
    "is_stateful",
    "snapshot",
]
