"""An agreement channel's address book in torch's in-memory ``HashStore``, for tests whose
ranks are threads of one process (a job's book is ``ChannelBook``, in etcd)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

KEY = "channel"


class StoreBook:
    """Publishes and finds a channel's record in a ``HashStore`` shared by the test's ranks."""

    def __init__(self, store: dist.Store | None = None) -> None:
        self.store = store or dist.HashStore()

    def publish(self, record: str) -> None:
        self.store.set(KEY, record)

    def find(self, timeout: timedelta) -> bytes:
        self.store.wait([KEY], timeout)
        return self.store.get(KEY)
