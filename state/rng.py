"""Random number generators as committed state, and per-sample seeding for data loading.

Owns ``RNGState`` (the process-wide torch CPU, CUDA, numpy and Python ``random`` generators
as one Stateful object, so a rollback replays dropout and augmentation) and
``SeededDataset`` (seeds every generator from ``(seed, epoch, sample index)`` around each
``__getitem__``, so augmentation is the same whichever DataLoader worker, rank or world size
loads the sample). Must not import ``elastic`` or ``checkpoint``.
"""

from __future__ import annotations

import random
from collections.abc import Sized
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from elastic.state.errors import StateError, StateKeyError
from elastic.state.global_batch import sample_seed

__all__ = ["RNGState", "SeededDataset", "seed_everything"]

_FORMAT_VERSION = 1
_KEYS = frozenset({"format_version", "torch", "cuda", "numpy", "python"})


class RNGState:
    """The process's generators (torch CPU and CUDA, numpy, Python ``random``) as a Stateful.

    Register it like any other object, ``ElasticState(..., rng=RNGState())``: every commit
    then snapshots the generators and every rollback or sync rewinds them, so a replayed
    step draws the same dropout masks and augmentations as the first time. After a sync all
    ranks hold the source rank's generators (identical streams on every rank).

    The state is small and plain: uint8/int64 tensors and ints, no numpy objects.
    """

    def state_dict(self) -> dict[str, Any]:
        """Returns the generators' states."""
        _, keys, pos, has_gauss, gauss = np.random.get_state()
        version, internal, gauss_next = random.getstate()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return {"format_version": _FORMAT_VERSION, "torch": torch.get_rng_state(),
                "cuda": list(cuda),
                "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)},
                "python": {"version": version,
                           "internal": torch.tensor(internal, dtype=torch.int64),
                           "gauss_next": gauss_next}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Sets the generators; CUDA states beyond this machine's devices are ignored.

        Args:
            state_dict: A dict from ``state_dict()``.

        Raises:
            StateKeyError: Keys are missing or unknown.
            StateError: The format version is not supported.
        """
        missing, unknown = sorted(_KEYS - set(state_dict)), sorted(set(state_dict) - _KEYS)
        if missing or unknown:
            raise StateKeyError(f"RNGState state has missing keys {missing} and unknown keys "
                                f"{unknown}.")
        if state_dict["format_version"] != _FORMAT_VERSION:
            raise StateError(f"RNGState format_version ({state_dict['format_version']}) is not "
                             f"supported; expected {_FORMAT_VERSION}.")
        torch.set_rng_state(state_dict["torch"].to(torch.uint8))
        if torch.cuda.is_available() and state_dict["cuda"]:
            count = min(torch.cuda.device_count(), len(state_dict["cuda"]))
            for device in range(count):
                torch.cuda.set_rng_state(state_dict["cuda"][device], device)
        numpy_state = state_dict["numpy"]
        np.random.set_state(("MT19937", numpy_state["keys"].numpy().astype(np.uint32),
                             int(numpy_state["pos"]), int(numpy_state["has_gauss"]),
                             float(numpy_state["gauss"])))
        py = state_dict["python"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["internal"].tolist()),
                         py["gauss_next"]))


def seed_everything(seed: int) -> None:
    """Seeds torch (CPU and CUDA), numpy and Python ``random`` with one value.

    Args:
        seed: Any integer; numpy gets it reduced to 32 bits.
    """
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)


class _EpochSource(Protocol):
    """What ``SeededDataset`` reads: ``ElasticSampler`` satisfies it."""

    @property
    def seed(self) -> int: ...

    @property
    def epoch(self) -> int: ...


class SeededDataset(Dataset):
    """Wraps a dataset so each sample's randomness depends only on (seed, epoch, index).

    Around every ``__getitem__(i)`` the generators are seeded with
    ``sample_seed(sampler.seed, sampler.epoch, i)``; random augmentation inside the
    wrapped dataset then replays identically after a rollback, in any DataLoader worker
    and for any world size. In the main process (``num_workers=0``) the generators are
    saved and put back, so the training loop's own stream is not disturbed; in a worker
    process they are simply reseeded.

    The epoch is read from the sampler when the DataLoader starts its workers (each
    ``iter(loader)``); ``persistent_workers=True`` would keep a stale epoch, so do not
    combine the two.

    Args:
        dataset: The map-style dataset to wrap.
        sampler: Where the seed and the current epoch come from (an ``ElasticSampler``).
    """

    def __init__(self, dataset: Dataset, sampler: _EpochSource) -> None:
        if not isinstance(dataset, Sized):
            raise ValueError(f"dataset ({type(dataset).__name__}) must have a length.")
        self.dataset = dataset
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        seed = sample_seed(self.sampler.seed, self.sampler.epoch, index)
        if get_worker_info() is not None:
            seed_everything(seed)
            return self.dataset[index]
        saved = RNGState().state_dict()
        try:
            seed_everything(seed)
            return self.dataset[index]
        finally:
            RNGState().load_state_dict(saved)
