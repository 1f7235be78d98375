"""Which GPU a worker uses, and the NCCL settings that re-forming in the same process needs.

Owns two decisions, both made before the first NCCL group and testable without a GPU:

- ``nccl_env``: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``. torch documents that
  ``_abort_process_group`` (how a group is released here) is meant to run with it off: with 1 or
  3 NCCL's watchdog tears the whole process down on a collective error, so a survivor would die
  instead of re-forming; with 2 the watchdog aborts communicators behind our back. A value the
  user set is kept, with one warning when it is not 0.
- ``claim_device``: the GPU index. ``LOCAL_RANK`` when set (``elastic run``, torchrun); else 0
  when only one device is visible; else, for workers started by hand without ``LOCAL_RANK``
  (which would all pick GPU 0), the lowest device of this host that no other live worker of
  this user holds: each worker holds an exclusive ``flock`` on one lock file per device for
  its whole life, and the kernel lets go of it when the process ends, however it ends.

Must not import torch (the caller passes the device count) nor touch etcd.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from elastic.cluster.links.fork_guard import guard as fork_guard
from elastic.foundation.errors import DeviceUnavailableError

log = logging.getLogger(__name__)

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def nccl_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set before the first NCCL group is created (empty when the user chose).

    Args:
        environ: the process's environment as it is.
    """
    chosen = environ.get(ASYNC_ERROR_HANDLING)
    if chosen is None:
        return {ASYNC_ERROR_HANDLING: "0"}
    if chosen.strip() != "0":
        log.warning("%s=%s is kept as you set it, but re-forming in the same process needs 0: "
                    "NCCL's watchdog may end or abort a survivor's group on its own",
                    ASYNC_ERROR_HANDLING, chosen)
    return {}


def apply_nccl_env(environ: MutableMapping[str, str]) -> None:
    """Sets ``nccl_env`` in ``environ`` (``os.environ``: torch reads it when a group is made)."""
    environ.update(nccl_env(environ))


def default_lock_dir() -> Path:
    """Where this user's workers claim devices: one directory per user in the temp dir."""
    return Path(tempfile.gettempdir()) / f"elastic-devices-{os.getuid()}"


@dataclass(frozen=True)
class DeviceClaim:
    """The GPU a worker uses and why.

    Attributes:
        index: the device index (in ``CUDA_VISIBLE_DEVICES``' order).
        source: how it was chosen, in words (for the log and the error messages).
        lock_fd: the descriptor holding the claim, kept open for the process's life; None when
            no claim was needed.
    """

    index: int
    source: str
    lock_fd: int | None = None


def claim_device(environ: Mapping[str, str], device_count: int, lock_dir: Path) -> DeviceClaim:
    """Chooses this worker's GPU (see the module's docstring).

    Args:
        environ: the process's environment (``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES``).
        device_count: how many devices this process sees.
        lock_dir: where the claims of this host's workers live.

    Raises:
        DeviceUnavailableError: no device visible, ``LOCAL_RANK`` beyond them, or every one
            claimed by another live worker.
    """
    if device_count < 1:
        raise DeviceUnavailableError("the nccl backend needs a GPU and this process sees none: "
                                     "check CUDA_VISIBLE_DEVICES, or use --backend gloo.")
    local_rank = environ.get("LOCAL_RANK", "").strip()
    if local_rank:
        index = int(local_rank)
        if not 0 <= index < device_count:
            raise DeviceUnavailableError(
                f"LOCAL_RANK={index} but this process sees {device_count} GPU(s): start at most "
                f"{device_count} workers on this host, or fix CUDA_VISIBLE_DEVICES.")
        return DeviceClaim(index, "LOCAL_RANK")
    if device_count == 1:
        return DeviceClaim(0, "the only visible GPU")
    names = _device_names(environ, device_count)
    lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for index, name in enumerate(names):
        fd = os.open(lock_dir / f"gpu-{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        fork_guard.hold([fd])  # a forked child must not keep the claim after this worker dies
        log.info("no LOCAL_RANK: using GPU %d, the lowest one no other worker of this host "
                 "holds (claims in %s)", index, lock_dir)
        return DeviceClaim(index, "the lowest GPU no other worker of this host holds", fd)
    raise DeviceUnavailableError(
        f"all {device_count} GPUs of this host are held by other workers (claims in {lock_dir}): "
        "start at most one worker per GPU, or set LOCAL_RANK (or CUDA_VISIBLE_DEVICES) for "
        "each worker.")


def _device_names(environ: Mapping[str, str], device_count: int) -> list[str]:
    """Host-wide names of the visible devices (two workers with different
    ``CUDA_VISIBLE_DEVICES`` must not claim the same physical GPU under different indices)."""
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(visible) >= device_count:
        return [v.replace("/", "_") for v in visible[:device_count]]
    return [str(i) for i in range(device_count)]
