"""A real etcd that takes few operations per transaction, as an operator may configure it."""

from __future__ import annotations

from elastic.launch.embedded_etcd import EmbeddedEtcd

MAX_TXN_OPS = 8  # etcd's --max-txn-ops; 128 by default


class SmallTxnEtcd(EmbeddedEtcd):
    """The embedded etcd with ``--max-txn-ops`` lowered to ``MAX_TXN_OPS``."""

    def _args(self, binary: str, peer_port: int) -> list[str]:
        return [*super()._args(binary, peer_port), "--max-txn-ops", str(MAX_TXN_OPS)]
