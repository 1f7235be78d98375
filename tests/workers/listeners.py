"""A worker that reports the addresses its own process listens on, once its group has formed.

After one commit (the round's group and agreement channel exist), rank 0 and rank 1 each write
``listeners-{rank}.json``: the local address of every listening TCP socket this process holds
(read from ``/proc/self/fd`` and ``/proc/net/tcp``).
"""

from __future__ import annotations

import json
import socket
import struct
import sys
from pathlib import Path

import torch

from elastic import ElasticState
from elastic.cluster.links.group_sockets import socket_fds

OUT = Path(sys.argv[1])
LISTEN = "0A"


def own_inodes() -> set[str]:
    return {str(inode) for inode in socket_fds().values()}


def listening_addresses() -> list[str]:
    mine, found = own_inodes(), []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == LISTEN and inode in mine:
            host_hex, port_hex = local.split(":")
            host = socket.inet_ntoa(struct.pack("<I", int(host_hex, 16)))
            found.append(f"{host}:{int(port_hex, 16)}")
    return found


def train(s: ElasticState) -> None:
    s.step += 1
    s.commit()
    (OUT / f"listeners-{s.rank}.json").write_text(json.dumps(listening_addresses()))
    s.commit()


ElasticState(model=torch.nn.Linear(2, 1), step=0).run(train)
