"""A TCP relay on 127.0.0.1 that can hold the server's answers: while held, what the client sends
goes through at once and what the server sends waits in the relay, in order, until let go. For
tests of what a client sends before it hears an answer; bytes pass unchanged and in order."""

from __future__ import annotations

import queue
import socket
import threading
from types import TracebackType

_CHUNK = 65536


class HeldLink:
    """Relays 127.0.0.1:``port`` to ``target``; ``hold`` keeps what ``target`` sends in the relay
    until ``let_go``.

    Use as a context manager: leaving it closes every socket, and its threads end with them.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()
        threading.Thread(target=self._accept, name="held-link-accept", daemon=True).start()

    def __enter__(self) -> HeldLink:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._closed.set()
        self._flowing.set()  # wakes every held release, which then sees the relay closed
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            s.close()

    def hold(self) -> None:
        """From now on, the server's answers wait in the relay."""
        self._flowing.clear()

    def let_go(self) -> None:
        """Sends the held answers, and every later one at once."""
        self._flowing.set()

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
            held: queue.Queue[bytes | None] = queue.Queue()
            threading.Thread(target=_pump, args=(far, None, held), daemon=True).start()
            threading.Thread(target=self._release, args=(held, near), daemon=True).start()

    def _release(self, held: queue.Queue[bytes | None], near: socket.socket) -> None:
        """Sends each answer once the link flows, unless the relay closes first."""
        while (data := held.get()) is not None:
            self._flowing.wait()  # set again by let_go or by closing the relay
            if self._closed.is_set():
                return
            try:
                near.sendall(data)
            except OSError:
                return


def _pump(source: socket.socket, sink: socket.socket | None,
          held: queue.Queue[bytes | None] | None = None) -> None:
    """Copies ``source`` to ``sink`` at once, or into ``held``."""
    try:
        while data := source.recv(_CHUNK):
            if held is not None:
                held.put(data)
            elif sink is not None:
                sink.sendall(data)
    except OSError:
        pass  # closed by the other side or by the test's exit
    finally:
        if held is not None:
            held.put(None)
