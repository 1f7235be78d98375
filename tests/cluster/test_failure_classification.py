"""Peer failure or the user's own failure: decided by type and by the group's own state.

The pure rule runs on fake states (unit); the transport evidence runs on a real 2-process gloo
group, where gloo reports a crashed peer as a plain RuntimeError.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic.cluster.links.process_group import ProcessGroup, is_peer_failure
from elastic.foundation.errors import FencedError, PeerFailureError
from tests.support.ranks import spawn_ranks

HEALTHY = {"released": False, "transport_broken": False}
NETWORK_SOUNDING = ["file closed", "Connection closed by peer", "socket timeout", "gloo",
                    "broken pipe", "NCCL error: process group aborted"]


@pytest.mark.unit
@pytest.mark.parametrize("message", NETWORK_SOUNDING)
@pytest.mark.parametrize("kind", [RuntimeError, ValueError, KeyError, OSError])
def test_a_users_error_is_never_a_peer_failure_whatever_its_message(kind, message):
    assert not is_peer_failure(kind(message), **HEALTHY)


@pytest.mark.unit
@pytest.mark.parametrize("error", [dist.DistBackendError("x"), dist.DistNetworkError("x"),
                                   dist.DistStoreError("x"), PeerFailureError("x"),
                                   FencedError("x")])
def test_torchs_distributed_errors_and_ours_are_peer_failures(error):
    assert is_peer_failure(error, **HEALTHY)


@pytest.mark.unit
def test_a_peer_failure_wrapped_by_user_code_is_still_found_in_the_cause_chain():
    try:
        try:
            raise dist.DistBackendError("NCCL communicator was aborted")
        except dist.DistBackendError as inner:
            raise ValueError("my training step failed") from inner
    except ValueError as outer:
        assert is_peer_failure(outer, **HEALTHY)
    try:
        try:
            raise PeerFailureError("agreement lost rank 0")
        except PeerFailureError:
            raise KeyError("while handling it, user code failed too")
    except KeyError as outer:
        assert is_peer_failure(outer, **HEALTHY)


@pytest.mark.unit
def test_any_error_after_the_watch_released_the_group_is_a_peer_failure():
    assert is_peer_failure(ValueError("whatever the collective raised"), released=True,
                           transport_broken=False)


@pytest.mark.unit
def test_any_error_while_the_groups_transport_lost_a_connection_is_a_peer_failure():
    assert is_peer_failure(RuntimeError("[pair.cc] Connection closed by peer"),
                           released=False, transport_broken=True)


@pytest.mark.unit
def test_a_cyclic_cause_chain_ends():
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__context__, second.__context__ = second, first
    assert not is_peer_failure(first, **HEALTHY)


def _rank(rank: int, store_path: str, scenario: str, results) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    store = dist.FileStore(store_path, 2)
    group = ProcessGroup("gloo", timeout=datetime.timedelta(seconds=30), skip_ports=frozenset(),
                         form_timeout=datetime.timedelta(seconds=30))
    group.form(store, rank, 2)
    if scenario == "crash" and rank == 1:
        os._exit(9)  # the kernel closes its sockets, as for a SIGKILLed worker
    try:
        if scenario == "crash":
            dist.all_reduce(torch.ones(2))
            results.put((rank, "no error", None))
            return
        dist.all_reduce(torch.ones(2))  # the group works
        raise RuntimeError("file closed")  # the user's own error, group healthy
    except RuntimeError as exc:
        results.put((rank, type(exc).__name__, group.is_peer_failure(exc)))
    if scenario == "user":
        dist.barrier()
        group.destroy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("scenario", "expected"), [
    ("crash", {0: ("RuntimeError", True)}),
    ("user", {0: ("RuntimeError", False), 1: ("RuntimeError", False)}),
])
def test_a_real_gloo_group_tells_a_crashed_peer_from_a_users_error(tmp_path: Path, scenario,
                                                                  expected):
    got = spawn_ranks(_rank, 2, str(tmp_path / "store"), scenario, reporting=len(expected))
    assert got == expected  # a crashed rank never reports
