"""A real etcd with some of its limits lowered, as an operator may configure it."""

from __future__ import annotations

from elastic.launch.embedded_etcd import EmbeddedEtcd

MAX_TXN_OPS = 8  # for --max-txn-ops (128 by default)


class LimitedEtcd(EmbeddedEtcd):
    """The embedded etcd with ``flags`` (``--max-txn-ops 8``, say) added to its command line."""

    def __init__(self, *flags: str) -> None:
        super().__init__()
        self._flags = list(flags)

    def _args(self, binary: str, peer_port: int) -> list[str]:
        return [*super()._args(binary, peer_port), *self._flags]
