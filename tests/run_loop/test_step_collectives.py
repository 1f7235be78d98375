"""The wait before a vote (``elastic.step_collectives``), in-process with plain futures."""

from __future__ import annotations

import threading
import weakref
from datetime import timedelta

import pytest
import torch

from elastic.foundation.errors import PeerFailureError
from elastic.step_collectives import StepCollectives

pytestmark = [pytest.mark.timeout(30), pytest.mark.unit]
LONG = timedelta(seconds=10)
LOOK = timedelta(milliseconds=20)


def test_the_wait_returns_only_once_a_tracked_future_completed_on_another_thread():
    collectives, future, completed = StepCollectives(), torch.futures.Future(), []
    collectives.track(future)
    later = threading.Timer(0.2, lambda: (completed.append(True), future.set_result(None)))
    later.start()
    collectives.wait(None, lambda: False, LONG, LOOK)
    assert completed == [True]
    later.join()


def test_a_tracked_collective_that_failed_fails_the_wait_with_its_error():
    collectives, future = StepCollectives(), torch.futures.Future()
    collectives.track(future)
    future.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        collectives.wait(None, lambda: False, LONG, LOOK)
    collectives.wait(None, lambda: False, LONG, LOOK)  # waited for once: the next vote is free


def test_collectives_that_completed_well_are_let_go_before_the_next_vote():
    # Every tracked future was kept, with its output tensors, until the next vote: an async
    # all-gather tracked at every step held a hundred steps of outputs at commit_every=100
    # (device memory under NCCL).
    collectives, failed = StepCollectives(), torch.futures.Future()
    output = torch.zeros(1024)
    held = weakref.ref(output)
    done = torch.futures.Future()
    done.set_result(output)
    collectives.track(done)
    del output, done
    collectives.track(failed)
    failed.set_exception(RuntimeError("Connection closed by peer"))
    collectives.track(_completed())
    assert held() is None
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # a failure is kept
        collectives.wait(None, lambda: False, LONG, LOOK)


def _completed() -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(None)
    return future


def test_a_released_group_fails_the_wait_as_a_peer_failure():
    with pytest.raises(PeerFailureError, match="released"):
        StepCollectives().wait(None, lambda: True, LONG, LOOK)


def test_a_release_that_does_not_wake_a_tracked_collective_still_fails_the_wait_at_once():
    collectives, looks = StepCollectives(), []
    collectives.track(torch.futures.Future())  # the release did not wake it: never completes

    def released() -> bool:  # released once the wait has begun
        looks.append(True)
        return len(looks) > 1

    with pytest.raises(PeerFailureError, match="released"):
        collectives.wait(None, released, LONG, LOOK)


def test_a_tracked_collective_that_never_completes_fails_the_wait_at_the_timeout():
    collectives = StepCollectives()
    collectives.track(torch.futures.Future())
    with pytest.raises(PeerFailureError, match="ELASTIC_COLLECTIVE_TIMEOUT"):
        collectives.wait(None, lambda: False, timedelta(milliseconds=50), LOOK)


def test_forget_drops_what_a_broken_round_tracked():
    collectives = StepCollectives()
    collectives.track(torch.futures.Future())
    collectives.forget()
    collectives.wait(None, lambda: False, timedelta(milliseconds=50), LOOK)


def test_track_names_what_it_takes_when_given_something_else():
    with pytest.raises(TypeError, match="Work or a torch.futures.Future"):
        StepCollectives().track(object())
