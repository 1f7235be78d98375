"""What is committed and how it moves: TrainState, ElasticSampler, Stateful helpers.

Knows torch and torch.distributed collectives; never imports ``elastic`` or ``checkpoint``.
"""

from elastic.state.errors import NoCommitError, StateError, StateKeyError, SyncError
from elastic.state.global_batch import Share, sample_seed
from elastic.state.lr_scaling import LinearLRScaling, SqrtLRScaling
from elastic.state.rng import RNGState, SeededDataset, seed_everything
from elastic.state.sampler import ElasticSampler
from elastic.state.stateful import Stateful, is_stateful, snapshot
from elastic.state.train_state import TrainState

__all__ = [
    "ElasticSampler",
    "LinearLRScaling",
    "RNGState",
    "SeededDataset",
    "Share",
    "SqrtLRScaling",
    "NoCommitError",
    "StateError",
    "StateKeyError",
    "Stateful",
    "SyncError",
    "TrainState",
    "is_stateful",
    "sample_seed",
    "seed_everything",
    "snapshot",
]
