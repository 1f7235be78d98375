"""A TCP relay on 127.0.0.1 whose replies arrive late: every chunk the server sends is held for a
fixed delay, so that each round trip through it costs at least that delay. For tests of how
many round trips a client needs; bytes pass unchanged and in order."""

from __future__ import annotations

import queue
import socket
import threading
import time
from types import TracebackType

_CHUNK = 65536


class SlowLink:
    """Relays 127.0.0.1:``port`` to ``target``, holding what ``target`` sends for ``delay_s``.

    Use as a context manager: leaving it closes every socket, and its threads end with them.
    """

    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        self._target = target
        self._delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="slow-link-accept", daemon=True).start()

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._closed.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
                far = socket.create_connection(self._target, timeout=10)
            except OSError:
                return  # closed
            far.settimeout(None)
            with self._lock:
                self._sockets += [near, far]
            threading.Thread(target=_pump, args=(near, far), daemon=True).start()
            held: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
            threading.Thread(target=_pump, args=(far, None, held), daemon=True).start()
            threading.Thread(target=self._release, args=(held, near), daemon=True).start()

    def _release(self, held: queue.Queue[tuple[float, bytes] | None],
                 near: socket.socket) -> None:
        """Sends each held chunk once its delay is over (the link's latency), unless the relay
        closes first."""
        while (item := held.get()) is not None:
            due, data = item
            if self._closed.wait(max(0.0, due + self._delay_s - time.monotonic())):
                return
            try:
                near.sendall(data)
            except OSError:
                return


def _pump(source: socket.socket, sink: socket.socket | None,
          held: queue.Queue[tuple[float, bytes] | None] | None = None) -> None:
    """Copies ``source`` to ``sink`` at once, or into ``held`` stamped with its arrival."""
    try:
        while data := source.recv(_CHUNK):
            if held is not None:
                held.put((time.monotonic(), data))
            elif sink is not None:
                sink.sendall(data)
    except OSError:
        pass  # closed by the other side or by the test's exit
    finally:
        if held is not None:
            held.put(None)
