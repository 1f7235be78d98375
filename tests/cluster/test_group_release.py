"""Releasing a gloo group shuts down the group's own connections and nobody else's."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic.cluster.links import process_group
from elastic.cluster.links.process_group import ProcessGroup
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


_GARBAGE_GROUP = """
import gc, os
from datetime import timedelta
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from elastic.cluster.links.process_group import ProcessGroup

os.environ["GLOO_SOCKET_IFNAME"] = "lo"
gc.disable()  # only the collections asked for below run
group = ProcessGroup("gloo", timedelta(seconds=30), frozenset(), timedelta(seconds=30))
group.form(dist.HashStore(), 0, 1)
dist.all_reduce(torch.ones(4))


class Holder:  # holds the group in a reference cycle, as the last round's DDP does
    pass


holder = Holder()
holder.group, holder.me = dist.group.WORLD, holder
del holder
group.release("the round ended")
group.destroy()


class Collecting(Dataset):  # the loader worker's collector runs, as it eventually does
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 0:
            gc.collect()
        return i


loader = DataLoader(Collecting(), batch_size=4, num_workers=1, timeout=10)
print("items", sum(len(batch) for batch in loader), flush=True)
"""


@pytest.mark.timeout(90)
def test_a_destroyed_group_held_by_garbage_is_freed_before_a_dataloader_forks_not_in_its_worker():
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    ran = subprocess.run([sys.executable, "-c", _GARBAGE_GROUP], capture_output=True, text=True,
                         env=env, timeout=60, check=False)
    assert ran.returncode == 0 and "items 8" in ran.stdout, (
        "the DataLoader worker hung freeing the destroyed group:\n" + ran.stderr[-1500:])
