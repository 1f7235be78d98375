"""The heartbeat process itself (``pulse_process`` starts it): every interval it reads its
worker's state in ``/proc`` and, unless the worker is stopped (SIGSTOP, a debugger: ``T``/``t``),
sends a heartbeat on every connection the worker handed it, at a priority above the worker's
where the system allows (``stay_runnable``). It ends when the worker's end of
the control socket ends (the worker's process ended or exec'd). Run by path with ``-I -S``: it
imports the standard library only, so that it is up long before the worker's first round.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time

BEAT = b"\xfe\x00"  # heartbeat.BEAT (this process imports nothing of the package)
_MAX_FDS = 1024
_STOPPED = ("T", "t")


def is_stopped(pid: int) -> bool | None:
    """Whether process ``pid`` is stopped; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read().decode("ascii", "replace")
    except OSError:
        return None
    return text[text.rindex(")") + 2:][:1] in _STOPPED


def stay_runnable() -> str:
    """Raises this process's priority where allowed, so that a CPU kept busy by processes of a
    higher priority delays its beats by microseconds, not seconds: the lowest real-time priority
    (it runs for microseconds per beat), else nice -10, else none (returned: which)."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        return "realtime"
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "nice"
    except OSError:
        return "none"


def _beat_loop(worker: int, interval_s: float, control: socket.socket) -> None:
    """The child: beats on the held connections every ``interval_s`` while ``worker`` runs."""
    held: dict[str, list[socket.socket]] = {}
    due = time.monotonic()
    while True:
        ready, _, _ = select.select([control], [], [], max(due - time.monotonic(), 0))
        if ready:
            message, fds, _, _ = socket.recv_fds(control, 256, _MAX_FDS)
            if not message:
                return  # the worker ended or exec'd
            verb, _, key = message.decode().partition(":")
            for sock in held.pop(key, []):
                sock.close()
            if verb == "hold":
                held[key] = [socket.socket(fileno=fd) for fd in fds]
            continue
        due = time.monotonic() + interval_s
        stopped = is_stopped(worker)
        if stopped is None:
            return
        if stopped:
            continue
        for socks in held.values():
            for sock in socks:
                try:
                    sock.send(BEAT, socket.MSG_DONTWAIT)
                except OSError:
                    pass  # full (the peer reads nothing: it is the one judged) or ended


if __name__ == "__main__":  # pulse_process starts it: worker pid, interval, control socket
    stay_runnable()
    _beat_loop(int(sys.argv[1]), float(sys.argv[2]), socket.socket(fileno=int(sys.argv[3])))
