"""Which of this launcher's worker processes ever joined the job, and which finished it.

A worker that crashed while registered still has its member key; one that joined, trained and
left (``run()`` returned or raised the user's error) has none any more, exactly like one that
never got as far as joining. Only the history tells them apart: this watch records the pid of
every member key this host ever wrote, from the launcher's start on, so that the crash message
can say "before it joined" only when that is true. Whether a worker said it returned from the
training function (``rounds/{n}/done/{member}`` in the newest round: restarting it after an
error cannot train anything, the job is over) is read when asked, for that worker only. The
launcher watches the job's member keys, not its rounds: a change costs it O(1), whatever the
size of the job.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable

from elastic.cluster.rounds import records
from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.rounds.keys import JobKeys
from elastic.foundation.errors import EtcdAccessError, EtcdRecordError, EtcdUnavailableError

log = logging.getLogger(__name__)


class JoinedWorkers:
    """Records the pids of this host's processes that registered as members.

    Args:
        client: the launcher's etcd client.
        keys: the job's keys (workers register under ``keys.members``).
        host: the host name the workers write in their member records (default: this host).
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, host: str | None = None) -> None:
        self.client = client
        self.keys = keys
        self.host = host or socket.gethostname()
        self._pids: set[int] = set()
        self._member_pids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._cancel: Callable[[], None] | None = None

    def start(self) -> None:
        """Notes the members registered now and watches for every later registration."""
        self._cancel = self.client.follow_prefix(self.keys.members, self._on_events)

    def stop(self) -> None:
        """Cancels the watch (the recorded pids stay readable)."""
        cancel, self._cancel = self._cancel, None
        if cancel is not None:
            cancel()

    def has_joined(self, pid: int) -> bool:
        """Whether process ``pid`` of this host ever registered as a member of the job."""
        with self._lock:
            return pid in self._pids

    def members_of(self, pid: int) -> list[str]:
        """The member ids that process ``pid`` of this host registered as."""
        with self._lock:
            return [m for m, p in self._member_pids.items() if p == pid]

    def has_finished(self, pid: int) -> bool:
        """Whether process ``pid`` of this host said it returned from the training function
        (in the newest round; False when etcd cannot tell now)."""
        members = self.members_of(pid)
        if not members:
            return False
        try:
            kv = self.client.get(self.keys.round)
            if kv is None:
                return False
            n = records.round_number(self.keys.round, kv.value)
            return any(self.client.get(self.keys.done(n, m)) is not None for m in members)
        except (EtcdUnavailableError, EtcdAccessError, EtcdRecordError) as exc:
            log.warning("could not read whether worker pid=%d had finished (%s); treating it "
                        "as not finished", pid, exc)
            return False

    def _on_events(self, events: list[WatchEvent]) -> None:
        for event in events:
            if event.kind == "put" and event.key.startswith(self.keys.members):
                self._note(event.key[len(self.keys.members):], event.value)

    def _note(self, member: str, value: bytes) -> None:
        try:
            info = json.loads(value)
        except ValueError:
            return  # not a member record of ours; validated by its readers
        if isinstance(info, dict) and info.get("host") == self.host \
                and isinstance(info.get("pid"), int):
            with self._lock:
                self._pids.add(info["pid"])
                self._member_pids[member] = info["pid"]
