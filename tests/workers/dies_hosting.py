"""``train.py``, except that the worker which hosts round ``DIE_HOSTING_ROUND``'s store is
killed (SIGKILL) the instant it published the store's address: the others have read it, or are
about to, and connect to a socket that is gone."""

from __future__ import annotations

import os
import signal

from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.links.round_store import RoundStore
from tests.workers import train

_host = RoundStore._host
_doomed = JobKeys(os.environ["ELASTIC_JOB_ID"]).store_address(int(os.environ["DIE_HOSTING_ROUND"]))


def host_then_die(self: RoundStore) -> None:
    _host(self)
    if self._key == _doomed:
        os.kill(os.getpid(), signal.SIGKILL)


RoundStore._host = host_then_die  # type: ignore[method-assign]

if __name__ == "__main__":
    train.main()
