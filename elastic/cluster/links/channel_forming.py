"""How one round's agreement channel is formed: rank 0 listens and publishes its address,
every other rank connects and is admitted, and each connection is set up (no delay, a kernel
timeout for a silent network, held from forked children).

A mixin of ``AgreementChannel`` (``agreement_channel``), kept apart so that each module stays
one concept: the channel owns its agreements, its watch and its teardown; this owns its
forming. Admission itself (the secret, turning strangers away) is ``admission``'s.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

from elastic.cluster.links.admission import AddressBook, Admission, RoundAddress, introduce
from elastic.cluster.links.channel_tcp import end_when_silent, listen
from elastic.cluster.links.fork_guard import guard as fork_guard
from elastic.foundation.errors import PeerFailureError


class ChannelForming:
    """Forming, for ``AgreementChannel``, which sets these attributes and ``release``s."""

    rank: int
    world_size: int
    _timeout_s: float
    _silence: timedelta | None
    _probe: timedelta | None
    _lock: threading.Lock
    _released: str | None
    _listener: socket.socket | None
    _address: RoundAddress | None
    _admission: Admission | None
    _peers: dict[int, socket.socket]
    _read_locks: dict[int, threading.Lock]

    def release(self, reason: str) -> None:
        raise NotImplementedError

    def open(self, book: AddressBook, advertise_addr: str) -> None:
        """Rank 0: listens on ``advertise_addr``, publishes the address with a fresh secret in
        ``book`` (before the round's store is hosted); else ``connect`` does.

        Raises:
            PeerFailureError: the channel was released, or publishing failed.
            AdvertiseAddressError: cannot listen on ``advertise_addr`` (not an address of this
                machine).
        """
        assert self.rank == 0, "only rank 0 opens the channel"
        if self.world_size == 1:
            return
        listener = listen(advertise_addr)
        address = RoundAddress.draw(*listener.getsockname()[:2])
        with self._lock:
            if self._released is not None:
                listener.close()
                raise PeerFailureError(f"the agreement channel was released: {self._released}")
            self._listener, self._address = listener, address
        try:
            book.publish(address.to_json())
        except (OSError, RuntimeError) as exc:
            self.release(f"publishing its address failed: {exc}")
            raise PeerFailureError(f"the agreement channel's address could not be published: "
                                   f"{exc}") from exc

    def connect(self, book: AddressBook, advertise_addr: str, round_: int,
                timeout: timedelta) -> None:
        """Connects every rank to rank 0 (collective: every rank of the round calls it).

        Raises:
            PeerFailureError: a peer did not connect in ``timeout``, or the channel was released.
            AdvertiseAddressError: rank 0 cannot listen on ``advertise_addr`` (not an address of
                this machine).
        """
        if self.world_size == 1:
            return
        if self.rank == 0 and self._address is None:
            self.open(book, advertise_addr)
        deadline = time.monotonic() + timeout.total_seconds()
        try:
            if self.rank == 0:
                self._accept_all(round_, deadline)
            else:
                self._connect_to_rank0(book, round_, deadline)
        except (OSError, RuntimeError, ValueError) as exc:
            self.release(f"connecting failed: {exc}")
            raise PeerFailureError(f"the agreement channel of round {round_} could not be "
                                   f"formed: {self._released}") from exc
        with self._lock:
            if self._released is not None:
                raise PeerFailureError(f"the agreement channel was released: {self._released}")
            for sock in self._peers.values():
                sock.settimeout(self._timeout_s)

    def _accept_all(self, round_: int, deadline: float) -> None:
        with self._lock:
            listener, address = self._listener, self._address
            if self._released is not None or listener is None or address is None:
                raise OSError(f"released before admitting: {self._released}")
            admission = Admission(listener, address, round_, self.world_size)
            self._admission = admission
        try:
            admitted = admission.run(deadline)
        finally:
            with self._lock:
                self._listener, self._admission = None, None
            listener.close()
            admission.close()
        for rank, conn in sorted(admitted.items()):
            self._adopt(rank, conn)

    def _connect_to_rank0(self, book: AddressBook, round_: int, deadline: float) -> None:
        address = RoundAddress.from_json(
            book.find(timedelta(seconds=max(deadline - time.monotonic(), 0.001))))
        conn = socket.create_connection((address.host, address.port),
                                        timeout=max(deadline - time.monotonic(), 0.001))
        self._adopt(0, conn)
        introduce(conn, address, round_, self.rank)

    def _adopt(self, rank: int, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._silence is not None and self._probe is not None:
            end_when_silent(conn, self._silence, self._probe)
        with self._lock:
            if self._released is not None:
                conn.close()
                raise OSError(f"released while connecting: {self._released}")
            self._peers[rank] = conn
            self._read_locks[rank] = threading.Lock()
        fork_guard.hold([conn.fileno()])  # a forked DataLoader worker must not keep it open
