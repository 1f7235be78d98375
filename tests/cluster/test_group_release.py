"""Releasing a gloo group shuts down the group's own connections and nobody else's."""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic.cluster import process_group
from elastic.cluster.process_group import ProcessGroup
from tests.support.ranks import spawn_ranks


def _rank(rank: int, store_path: str, results) -> None:  # noqa: ANN001 (a spawn queue)
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    server = socket.create_server(("127.0.0.1", 0))
    bystander: list[socket.socket] = []
    real_barrier = process_group.dist.barrier

    def barrier_with_a_bystander(*args, **kwargs):
        # Another thread of this process (an upload, say) connects while the group forms.
        bystander.append(socket.create_connection(server.getsockname()))
        return real_barrier(*args, **kwargs)

    process_group.dist.barrier = barrier_with_a_bystander
    group = ProcessGroup("gloo", timeout=datetime.timedelta(seconds=30), skip_ports=frozenset(),
                         form_timeout=datetime.timedelta(seconds=30))
    group.form(dist.FileStore(store_path, 2), rank, 2)
    process_group.dist.barrier = real_barrier
    accepted, _ = server.accept()
    group.release("a test")
    try:
        dist.all_reduce(torch.ones(2))
        collective = "no error"
    except RuntimeError:
        collective = "failed"
    try:
        bystander[0].sendall(b"still here")
        echoed = accepted.recv(10)
    except OSError as exc:
        echoed = f"broken: {exc!r}".encode()
    results.put((rank, collective, echoed))


@pytest.mark.timeout(120)
def test_release_leaves_a_connection_another_thread_opened_while_the_group_formed(
        tmp_path: Path):
    got = spawn_ranks(_rank, 2, str(tmp_path / "store"))
    assert got == {0: ("failed", b"still here"), 1: ("failed", b"still here")}
