"""What ties the members of one round together, and the order in which it is let go.

A round is held together by three things: its agreement channel, its etcd-backed store and its
process group. ``RoundLinks`` owns them for one worker and owns the two orders that matter:

- ``release(reason)``, from any thread: wakes everything blocked on the round. The channel and
  the store go first because releasing them only shuts sockets down and wakes waiters, while
  releasing an NCCL group aborts communicators and can take a while; a group still forming is
  waiting on the store, so aborting the store is what frees it.
- ``drop()``, from the training thread once released: destroys the group, then closes the
  store the group was formed on (``drop_meanwhile``: on a thread of its own, while the
  training thread asks for its next round; destroying a group takes milliseconds). The released channel is *retired*, not closed: it stays open
  until the next round opens (or ``close()``), because until then a connection that a peer
  ended tells that the peer died (``AgreementChannel.peers_gone``), and closing ours would tell
  the peers the same lie about this worker.

It does not decide when to release (the round tracker and the run loop do) nor how to form.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol


class Channel(Protocol):
    def release(self, reason: str) -> None: ...
    def close(self) -> None: ...


class Store(Protocol):
    def abort(self, reason: str) -> None: ...
    def close(self) -> None: ...


class Group(Protocol):
    def release(self, reason: str) -> None: ...
    def destroy(self) -> None: ...


class RoundLinks:
    """The channel, store and group of this worker's current round.

    Args:
        group: the worker's process group (kept across rounds; formed anew in each).
        channel: the channel to hold before the first round (an unconnected one).
    """

    def __init__(self, group: Group, channel: Channel) -> None:
        self.group = group
        self.channel = channel
        self.store: Store | None = None

    def open(self, store: Store, channel: Channel) -> None:
        """Takes the next round's store and channel, and closes the retired channel; the previous
        round must have been dropped."""
        assert self.store is None, "drop() the previous round before opening the next"
        self.store = store
        retired, self.channel = self.channel, channel
        retired.close()

    def release(self, reason: str) -> None:
        """Unblocks every collective, agreement and group formation of the round now."""
        self.channel.release(reason)
        store = self.store  # read once: the training thread may drop it meanwhile
        if store is not None:
            store.abort(reason)
        self.group.release(reason)

    def drop(self) -> None:
        """Destroys the round's group and closes its store; the channel is kept (retired)."""
        self.group.destroy()
        store, self.store = self.store, None
        if store is not None:
            store.close()

    def drop_meanwhile(self, limit: timedelta) -> Callable[[], None]:
        """``drop()`` on a thread of its own; returns what waits for it (for at most ``limit``)
        and raises what it raised, to be called before ``open``.

        Raises (the returned function):
            TimeoutError: the drop did not finish within ``limit``.
        """
        failed: list[Exception] = []

        def drop() -> None:
            try:
                self.drop()
            except Exception as exc:  # noqa: BLE001 (raised again by the waiter)
                failed.append(exc)

        thread = threading.Thread(target=drop, name="elastic-drop-round", daemon=True)
        thread.start()

        def dropped() -> None:
            thread.join(limit.total_seconds())
            if thread.is_alive():
                raise TimeoutError(f"destroying the last round's group took longer than {limit}")
            if failed:
                raise failed[0]

        return dropped

    def close(self) -> None:
        """Drops the round and closes its channel (the worker leaves the job)."""
        self.drop()
        self.channel.close()
