"""The step's collectives, waited for before a rank votes at an agreement.

Owns the rule that a rank votes "yes" (``commit``, ``commit_step``, ``check_membership``) only
once every collective of its step is known to have completed without error. A returned
``backward()`` does not say so everywhere: on NCCL, DDP's all-reduce is only enqueued on the
GPU stream, and an asynchronous communication hook or an ``async_op=True`` collective may still
be running. What is waited for: on a GPU, the current stream (DDP makes it wait for its
all-reduces), then the NCCL backend's own error state; every ``Work`` or ``Future`` the loop
handed to ``track``; and whether the group was released meanwhile. Knows nothing of the
agreement itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.foundation.errors import PeerFailureError

__all__ = ["StepCollectives"]


class StepCollectives:
    """The asynchronous collectives of the current step, and the wait before a vote."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[torch.futures.Future] = []

    def track(self, work: Any) -> None:
        """Has the next agreement wait for ``work`` (a ``dist.Work`` or a ``torch.futures.Future``).

        Raises:
            TypeError: ``work`` is neither.
        """
        future = work.get_future() if isinstance(work, dist.Work) else work
        if not isinstance(future, torch.futures.Future):
            raise TypeError(f"track() takes a torch.distributed Work or a torch.futures.Future, "
                            f"got {type(work).__name__}; pass what async_op=True or a comm hook returns.")
        with self._lock:  # those that completed well are let go, with their outputs
            self._pending = [f for f in self._pending if _unsettled(f)] + [future]

    def forget(self) -> None:
        """Drops what a broken round left tracked: it is rolled back, not waited for."""
        with self._lock:
            self._pending = []

    def wait(self, device_index: int | None, is_released: Callable[[], bool],
             timeout: timedelta, look_every: timedelta) -> None:
        """Returns once the step's collectives completed; raises if any of them failed.

        Args:
            device_index: the round's GPU (an NCCL group's), or None on CPU.
            is_released: whether the round's group was released (a peer failed).
            timeout: the longest wait for the tracked collectives (the collective timeout).
            look_every: how often a wait for a tracked collective looks at ``is_released``
                (a release need not wake it).

        Raises:
            PeerFailureError: the group was released, NCCL reported an error, or a tracked
                collective did not complete within ``timeout``.
            Exception: what a failed tracked collective raised (the run loop classifies it).
        """
        with self._lock:
            pending, self._pending = self._pending, []
        deadline = time.monotonic() + timeout.total_seconds()
        for future in pending:
            _wait_for(future, deadline, timeout, is_released, look_every)
        if device_index is not None and torch.cuda.is_available():
            # after the futures: an NCCL work's future completes once it is enqueued, and its
            # wait() made this stream wait for it, as DDP does for its all-reduces; the
            # stream's end is where they are known to have run
            device = torch.device("cuda", device_index)
            torch.cuda.current_stream(device).synchronize()
            _raise_nccl_error(device)
        if is_released():
            raise PeerFailureError(_RELEASED)


_RELEASED = ("the process group was released before this step's collectives were known to "
             "have completed")


def _wait_for(future: torch.futures.Future, deadline: float, timeout: timedelta,
              is_released: Callable[[], bool], look_every: timedelta) -> None:
    """Waits for ``future`` until ``deadline`` at most, or until the group is released;
    raises what it failed with."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    while not done.is_set():
        if is_released():
            raise PeerFailureError(_RELEASED)
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerFailureError(
                f"an asynchronous collective of this step did not complete within the "
                f"collective timeout ({timeout}); a peer is stuck, or it is only slow: then "
                f"raise ELASTIC_COLLECTIVE_TIMEOUT.")
        done.wait(min(left, look_every.total_seconds()))
    future.wait()


def _raise_nccl_error(device: torch.device) -> None:
    """Raises PeerFailureError when the default group's NCCL backend reports an error.

    ``get_error`` is the NCCL backend's own error state (torch's ``ErrorType``), as torchft
    reads it; a build whose backend lacks it is left to the release and the next collective.
    """
    if not dist.is_initialized():
        return
    backend = dist.group.WORLD._get_backend(device)  # type: ignore[union-attr]
    get_error = getattr(backend, "get_error", None)
    if get_error is None:
        return
    error = get_error()
    if error != torch._C._distributed_c10d.ErrorType.SUCCESS:
        raise PeerFailureError(f"NCCL reported {error} for this step's collectives")


def _unsettled(future: torch.futures.Future) -> bool:
    """Whether a vote still needs ``future``: not done yet, or done with an error."""
    if not future.done():
        return True
    try:
        future.value()
    except Exception:  # torch re-raises the collective's error, of whatever type it set
        return True
    return False
