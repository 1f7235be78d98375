"""torch.distributed process-group lifecycle in a long-lived process: form, release, destroy.

No etcd here: the caller hands in a store, rank and world size. ``release()`` may be called from
another thread (the membership watcher) to unblock a collective that waits on a peer which is
gone or frozen:

- NCCL: the communicators are aborted, on a thread of its own (an abort can take a while, and
  ``release`` is called from the etcd client's event loop, whose keepalives must not stall);
  ``destroy`` waits for it. Before the first group, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``
  (``device.nccl_env``), and the group is made with ``device_id``, so that NCCL creates its
  communicators inside ``init_process_group``, right after every member was seen alive, not
  inside the first collective (creation itself still blocks: ``TORCH_NCCL_USE_COMM_NONBLOCKING``
  is not set, untried without a GPU).
- gloo (torch 2.13 has no abort that unblocks an in-flight collective): the receiving side of
  each of the group's own connections, recorded when it was formed, is shut down; gloo's thread
  reads that as the end of the stream and fails every wait of this process. The connection
  itself stays open until ``destroy`` (a copy of it is held), so that the release makes no
  send fail, neither this process's nor a peer's: gloo's pair queues a send whose write fails
  (broken pipe, reset) and never wakes it when the pair then closes, and the collective would
  wait in ``waitSend`` until the collective timeout. A collective that the release did not
  wake all the same (seen: gloo's worker thread still in a ring all-reduce's receive) holds
  that thread, which the group's destructor joins: ``destroy`` frees the groups on a thread
  of its own and waits for a gloo one only briefly. A release that lands while the group forms,
  before its connections are known, is applied to them once they are (and to a subgroup's at
  ``adopt``). Identities are checked by inode before use, so a reused descriptor number is
  never touched; gloo's listening socket is never touched (shutting it down ends the
  process).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.cluster.links import group_sockets
from elastic.cluster.links.device import apply_nccl_env
from elastic.cluster.links.fork_guard import guard as fork_guard
from elastic.cluster.links.interfaces import socket_interface_env
from elastic.foundation.errors import FencedError, PeerFailureError

log = logging.getLogger(__name__)

_CAUSE_DEPTH = 16  # how far an exception's cause chain is followed


def resolve_backend(backend: str) -> str:
    """Maps "auto" to nccl when CUDA is available, gloo otherwise.

    Raises:
        ValueError: an unknown backend, or nccl without CUDA.
    """
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r} must be one of auto, gloo, nccl.")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, and none is available: use gloo or auto.")
    return backend


def cuda_device_count() -> int:
    """How many GPUs this process sees."""
    return torch.cuda.device_count()


def _abort_nccl() -> None:
    """Aborts the default group's NCCL communicators (unblocks every collective on them)."""
    group = dist.group.WORLD
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort(group)
    elif group is not None:
        group.abort()


def _reset_group_names() -> None:
    """Starts torch's group-name counter from 0 again before a new default group.

    The counter names the group's store keys. ``destroy_process_group`` resets it, but an
    ``init_process_group`` that failed half-way (a peer died while connecting) leaves it advanced
    in this process only, and every later formation would then wait for keys its peers write
    under another name. No group exists here, so no name can clash.
    """
    world = dist.distributed_c10d._world
    if not dist.is_initialized() and hasattr(world, "group_count"):
        world.group_count = 0


def _every_group() -> list[Any]:
    """Every process group torch holds (the default one and its subgroups): references that
    outlive ``destroy_process_group``, so that no group's destructor runs inside it."""
    return list(dist.distributed_c10d._world.pg_map)


def _free_on_a_thread(groups: list[Any]) -> threading.Thread:
    """Drops the references ``groups`` on a thread of its own, and returns that thread.

    A gloo group's destructor joins its worker threads. One still inside a collective that the
    release did not wake ends only at the collective timeout, and the next round need not wait
    for it: that thread and the group's connections are freed then.
    """
    thread = threading.Thread(target=groups.clear, name="elastic-free-group", daemon=True)
    thread.start()
    return thread


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from or while handling, nearest first."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain and len(chain) < _CAUSE_DEPTH:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def is_peer_failure(exc: BaseException, *, released: bool, transport_broken: bool) -> bool:
    """Whether ``exc`` means that the group lost a peer, decided by type and by the group's state.

    A peer failure is: any exception once the group was released (by the membership watch, or
    for a re-formation); one of our own ``PeerFailureError``/``FencedError`` or torch's
    ``DistError`` family (``DistBackendError``, ``DistNetworkError``, ``DistStoreError``) anywhere
    in its cause chain; or any exception while the group's transport shows a lost connection
    (gloo reports a crashed peer as a plain ``RuntimeError``, and closes that peer's socket).
    Anything else is the caller's own failure, whatever its type or message.

    Args:
        exc: what a collective, the state sync or the user's function raised.
        released: whether the group was released before ``exc`` was classified.
        transport_broken: whether a connection of the group was lost (``ProcessGroup.is_broken``).
    """
    if released or transport_broken:
        return True
    return any(isinstance(cause, (PeerFailureError, FencedError, dist.DistError))
               for cause in _causes(exc))


class ProcessGroup:
    """The default process group of one round, formed and released in the same process.

    Args:
        backend: "gloo" or "nccl" (resolved already).
        timeout: the group's collective timeout (a backstop; release() is the fast path).
        skip_ports: remote ports of connections that are not the group's (etcd's).
        form_timeout: how long forming may take. A member that dies while the others connect
            to it cannot be released (gloo waits on its listening socket), so the formation
            runs under this short timeout and the group gets ``timeout`` once it is formed.
        advertise_addr: the address peers reach this worker on; gloo and NCCL listen on its
            interface only (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, unless set already).
        device_index: the GPU of an NCCL group (``device.claim_device``); None for gloo.
        abort: how an NCCL group's communicators are aborted (torch's abort by default; a test
            passes its own).
        free_timeout: how long ``destroy`` waits for a gloo group to be freed (``form_timeout``
            when None). Waited for at all because a process that exits while a group is being
            freed aborts; a group that takes longer is left to its collective's end.
    """

    def __init__(self, backend: str, timeout: timedelta, skip_ports: frozenset[int],
                 form_timeout: timedelta, advertise_addr: str = "127.0.0.1",
                 device_index: int | None = None,
                 abort: Callable[[], None] | None = None,
                 free_timeout: timedelta | None = None) -> None:
        if backend == "nccl" and device_index is None:
            raise ValueError("an nccl ProcessGroup needs a device_index (device.claim_device).")
        self.backend = backend
        self.advertise_addr = advertise_addr
        self.device_index = device_index
        self._abort = abort or _abort_nccl
        self._aborting: threading.Thread | None = None
        self.timeout = timeout
        self.form_timeout = form_timeout
        self.free_timeout = form_timeout if free_timeout is None else free_timeout
        self._skip_ports = skip_ports
        self._sockets: list[group_sockets.SocketId] = []
        self._held: list[int] = []  # every socket the formation opened, let go of in children
        self._kept: list[socket.socket] = []  # released connections, open until destroy()
        self._destroyed = 0  # how many times destroy() ran (a release meanwhile lets go itself)
        self._lock = threading.Lock()
        self._released = threading.Event()
        # sys.excepthook before and after torch wrapped it with "[rankN]: " at a formation.
        self._excepthooks: tuple[Any, Any] | None = None

    @property
    def is_released(self) -> bool:
        return self._released.is_set()

    def is_broken(self) -> bool:
        """Whether a connection of the formed gloo group was lost (closed, reset, or half-closed
        by the peer). gloo closes the socket of a peer it saw fail; the kernel marks one whose
        peer process died. False for NCCL, whose failures raise typed errors."""
        with self._lock:
            sockets = list(self._sockets)
        if self.backend != "gloo" or not sockets:
            return False
        current, states = group_sockets.socket_fds(), group_sockets.tcp_states()
        return any(current.get(s.fd) != s.inode
                   or states.get(s.inode) != group_sockets.TCP_ESTABLISHED for s in sockets)

    def is_peer_failure(self, exc: BaseException) -> bool:
        """See ``is_peer_failure``: decided from this group's own state."""
        return is_peer_failure(exc, released=self.is_released, transport_broken=self.is_broken())

    def form(self, store: dist.Store, rank: int, world_size: int) -> None:
        """Initialises the default group; returns once every rank has connected."""
        # torch reads the interface from the environment only; a user's choice is kept.
        os.environ.update(socket_interface_env(self.advertise_addr, os.environ))
        before = group_sockets.socket_fds()
        device = None
        if self.backend == "nccl":
            apply_nccl_env(os.environ)  # read by torch when the group is made
            device = torch.device("cuda", self.device_index)
            torch.cuda.set_device(device)
        _reset_group_names()
        self._unwrap_excepthook()
        hook_before = sys.excepthook
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size,
                                timeout=self.form_timeout, device_id=device)
        self._excepthooks = (hook_before, sys.excepthook)
        if self.backend == "gloo":
            # gloo connects the full mesh lazily on some builds: one collective forces it.
            dist.barrier()
        dist.distributed_c10d._set_pg_timeout(self.timeout)
        new, ends = group_sockets.opened_since(before)
        fork_guard.hold(list(new))  # a forked DataLoader worker must not keep them open
        listeners = self._listener_ports(ends) if self.backend == "gloo" else set()
        self._record(new, group_sockets.of_group(new, ends, listeners, self._skip_ports))

    @staticmethod
    def sockets_now() -> dict[int, int]:
        """This process's sockets ({fd: inode}), to hand to ``adopt`` after making subgroups."""
        return group_sockets.socket_fds()

    def adopt(self, before: dict[int, int]) -> None:
        """Takes in the connections opened since ``before`` (``sockets_now``) by subgroups of
        this round (a ``DeviceMesh``'s, a side group's): ``release`` shuts them down too and
        ``is_broken`` watches them, so a peer that dies in a subgroup's collective is seen as a
        peer failure like one in the default group's. Call it while nothing else connects."""
        new, ends = group_sockets.opened_since(before)
        fork_guard.hold(list(new))
        self._record(new, group_sockets.of_group(new, ends, set(), self._skip_ports))

    def _record(self, new: dict[int, int], found: list[group_sockets.SocketId]) -> None:
        """Takes in the sockets ``new`` (let go of in children) and the group's connections
        among them, ``found``: ``release`` shuts those. A release that came first knew none of
        them: they are shut here."""
        with self._lock:
            self._held.extend(new)
            late = self._released.is_set() and self.backend == "gloo"
            if not late:
                self._sockets.extend(found)
            destroyed = self._destroyed
        if late:
            self._shut(found, destroyed)

    @staticmethod
    def _listener_ports(ends: dict[int, tuple[int, int | None]]) -> set[int]:
        """Every rank's gloo listening port (one small all-gather), from the listening socket
        this rank's group opened; empty when some rank found none."""
        mine = [local for local, remote in ends.values() if remote is None]
        port = torch.tensor([mine[0] if len(mine) == 1 else 0], dtype=torch.int64)
        ports = [torch.zeros_like(port) for _ in range(dist.get_world_size())]
        dist.all_gather(ports, port)
        found = {int(p.item()) for p in ports}
        return set() if 0 in found else found

    def release(self, reason: str) -> None:
        """Unblocks every collective of this group now; safe from any thread, idempotent. On
        gloo its connections end only at ``destroy`` (see the module's docstring)."""
        with self._lock:
            if self._released.is_set() or not dist.is_initialized():
                return
            self._released.set()
            sockets, self._sockets = self._sockets, []
            destroyed = self._destroyed
        log.info("releasing process group: %s", reason)
        if self.backend == "nccl":
            self._aborting = threading.Thread(target=self._abort, name="elastic-nccl-abort",
                                              daemon=True)
            self._aborting.start()
            return
        self._shut(sockets, destroyed)

    def _shut(self, sockets: list[group_sockets.SocketId], destroyed: int) -> None:
        """Shuts the receiving side of gloo connections ``sockets`` and holds them open until
        ``destroy`` (``destroyed``: its count when they were taken)."""
        kept = group_sockets.shut_receiving(sockets)
        with self._lock:
            if self._destroyed == destroyed:
                self._kept += kept
                return
        group_sockets.let_go(kept)  # destroyed meanwhile: nothing is left to hold open

    def destroy(self) -> None:
        """Destroys the default group (after release() if a peer may be stuck), once an abort
        in flight has finished (for at most ``form_timeout``), then ends the connections a
        release held open. The groups are freed on a thread of their own, waited for at most
        ``free_timeout`` (gloo) or ``form_timeout`` (NCCL)."""
        aborting, self._aborting = self._aborting, None
        if aborting is not None:
            aborting.join(self.form_timeout.total_seconds())
            if aborting.is_alive():
                log.warning("aborting the NCCL communicators took longer than %s; destroying "
                            "the group anyway", self.form_timeout)
        with self._lock:
            self._sockets = []
            held, self._held = self._held, []
        fork_guard.release(held)
        try:
            if dist.is_initialized():
                groups = _every_group()
                dist.destroy_process_group()
                fork_guard.collect_before_next_fork()  # an old DDP may still hold the group
                freeing = _free_on_a_thread(groups)
                # NCCL: its communicators' memory goes before the next ones are made.
                limit = self.form_timeout if self.backend == "nccl" else self.free_timeout
                freeing.join(limit.total_seconds())
                if freeing.is_alive():
                    log.warning("freeing the last round's %s group took longer than %s (a "
                                "collective the release did not wake); going on without it",
                                self.backend, limit)
        finally:
            with self._lock:
                self._destroyed += 1
                kept, self._kept = self._kept, []
            group_sockets.let_go(kept)
        self._unwrap_excepthook()
        self._released.clear()

    def _unwrap_excepthook(self) -> None:
        """Puts back the excepthook torch wrapped at the formation, so that the next formation
        wraps it once with its own rank instead of stacking a prefix per round; a hook the
        user installed since is left alone."""
        hooks, self._excepthooks = self._excepthooks, None
        if hooks is not None and sys.excepthook is hooks[1]:
            sys.excepthook = hooks[0]
