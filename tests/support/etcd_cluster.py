"""A real etcd cluster of three members on 127.0.0.1, for the tests of member faults.

Each member is the embedded etcd's server (the same binary, niceness and ``GOMAXPROCS``) with
its own client and peer ports, data directory and ``--name``, and one ``--initial-cluster``
naming all three. A member alone is healthy only once the cluster has a leader, so the three
are spawned first and waited for together. Members are killed, frozen, resumed and restarted on
their data one by one (``EmbeddedEtcd``'s ``process``, ``pause``, ``resume``, ``restart``);
``stop`` ends every one of them, pass or fail.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

from elastic.cluster.links.ports import free_port
from elastic.foundation.errors import EtcdUnavailableError
from elastic.launch.embedded_etcd import HOST, EmbeddedEtcd, find_etcd_binary

SIZE = 3
ATTEMPTS = 3  # sets of ports tried when one turns out to be taken
STATUS_TIMEOUT_S = 2.0  # one status request to a member that should answer


class ClusterMember(EmbeddedEtcd):
    """One member of an ``EtcdCluster``: the embedded etcd with a name and the whole cluster's
    peer list (its ports are the cluster's to choose)."""

    def __init__(self, name: str, data_dir: Path) -> None:
        super().__init__(str(data_dir))
        self.name = name
        self.initial_cluster = ""
        self.token = ""

    @property
    def peer_url(self) -> str:
        return f"http://{HOST}:{self._peer_port}"

    def place(self, client_port: int, peer_port: int) -> None:
        """Takes these ports (before ``spawn``)."""
        self.client_port, self._peer_port = client_port, peer_port

    def spawn(self) -> None:
        """Starts the process; ``healthy`` tells when the cluster answers through it."""
        self._binary = find_etcd_binary()
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        self._spawn(self._binary, self._peer_port)

    def healthy(self) -> bool:
        """Waits (``Timeouts.etcd_start``) until it answers its health check, lowering its
        priority then; False when it did not or exited."""
        if not self._wait_healthy():
            return False
        self._lower_priority()
        return True

    def is_leader(self) -> bool:
        """Whether this member leads the cluster now (its status, over the gRPC gateway)."""
        request = urllib.request.Request(f"{self.url}/v3/maintenance/status", data=b"{}",
                                         method="POST")
        with urllib.request.urlopen(request, timeout=STATUS_TIMEOUT_S) as reply:
            status = json.loads(reply.read())
        return status.get("leader") == status["header"]["member_id"]  # absent: none (0)

    def _args(self, binary: str, peer_port: int) -> list[str]:
        return [
            binary, "--name", self.name, "--data-dir", str(Path(self.data_dir) / "data"),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster, "--initial-cluster-token", self.token,
            "--initial-cluster-state", "new",
            "--listen-metrics-urls", f"http://{HOST}:{free_port()}",
            "--log-level", "warn",
        ]


class EtcdCluster:
    """Three etcd members forming one cluster on 127.0.0.1.

    Args:
        root: a directory for the members' data and logs (``{root}/m1`` ...).
    """

    def __init__(self, root: Path) -> None:
        self.members = [ClusterMember(f"m{i + 1}", root / f"m{i + 1}") for i in range(SIZE)]

    @property
    def urls(self) -> str:
        """The client URLs, comma-separated, the first member's first."""
        return ",".join(member.url for member in self.members)

    def start(self) -> EtcdCluster:
        """Starts the members and waits until each answers.

        Raises:
            EtcdUnavailableError: no set of ports made a healthy cluster.
        """
        for attempt in range(ATTEMPTS):
            for member in self.members:
                member.place(free_port(), free_port())
            initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
            token = f"elastic-test-{self.members[0].client_port}-{attempt}"
            for member in self.members:
                member.initial_cluster, member.token = initial, token
                member.spawn()
            if all(member.healthy() for member in self.members):
                return self
            self.stop()
            for member in self.members:  # a fresh cluster on the next ports
                shutil.rmtree(Path(member.data_dir) / "data", ignore_errors=True)
        raise EtcdUnavailableError(
            f"a cluster of {SIZE} etcd members did not become healthy in {ATTEMPTS} attempts; "
            f"see {', '.join(str(m.log_path) for m in self.members)}.")

    def leader(self, among: list[ClusterMember]) -> ClusterMember | None:
        """The member of ``among`` (live ones) that leads the cluster; None while none does
        (an election is under way)."""
        return next((member for member in among if member.is_leader()), None)

    def stop(self) -> None:
        """Stops every member (a frozen one is continued first)."""
        for member in self.members:
            member.stop()

