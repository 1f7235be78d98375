"""Sharded state (FSDP2 / HSDP) in an elastic job: the objects of each formation and their
commits in host memory.

Owns the cluster-facing half of ``ElasticState(parallelize=...)``: calling the user's
``parallelize(mesh)`` at every formation on the round's mesh (``sharded_mesh``), choosing the
newest commit that some live rank holds of every shard and filling the new objects from it
(``sharded_reshard``, after ``sharded_models`` found every rank's model alike) or from a
durable checkpoint; at commits, the host copy and the buddy copies on a group of their own.
Must not know how durable sharded checkpoints are written: that is the writer and loader
hooks' business (``checkpoint/``).
"""

from __future__ import annotations

import gc
import logging
import os
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from elastic.cluster.links.process_group import ProcessGroup
from elastic.cluster.rounds.topology import Topology
from elastic.foundation.errors import ElasticError, PeerFailureError
from elastic.foundation.events import EventLog
from elastic.sharded_imports import AheadImports
from elastic.sharded_mesh import mesh_layout, round_mesh
from elastic.sharded_models import check_built
from elastic.sharded_reshard import Seat, reshard
from elastic.state import TrainState, snapshot
from elastic.state.sharded.commits import Choice, ShardCommit, ShardCommits, choose, read_report
from elastic.state.sharded.copies import BuddyCopyError, BuddyExchange
from elastic.state.sharded.layout import ShardLostError, TensorSpec
from elastic.state.sharded.shards import (MODEL, flat_tensors, hold_every_tensor,
                                          host_copy, local_part, sharded_state_dict, spec_of)

log = logging.getLogger(__name__)

Parallelize = Callable[[DeviceMesh], dict[str, Any]]
# The durable hooks (elastic.sharded_durable): the loader fills a formation's objects from the
# newest durable sharded checkpoint and returns its small state (``TrainState.committed()``),
# None when there is none (its second argument: whether a shard was lost); the writer gets the
# version, the sharded state dict (DTensors) and that payload, on every rank.
DurableLoader = Callable[[dict[str, Any], bool], dict[str, Any] | None]
DurableWriter = Callable[[int, dict[str, Any], dict[str, Any]], None]


class ShardedStateLostError(ElasticError):
    """Every holder of some shard of the last commit is gone, and no durable sharded checkpoint
    can be loaded instead."""


class ShardedRuntime:
    """The sharded objects of the current formation and their commits.

    Args:
        parallelize: the user's ``parallelize(mesh) -> {"model": ..., "optimizer": ...}``.
        shard_degree: None for FSDP over all ranks; S for HSDP with S-way shards.
        buddies: extra host copies of each rank's shards under FSDP (0 to keep none).
        timeout: bound on waiting for the buddy copies in flight.
        released_wait: bound on that wait once the round was released (a peer failed): the
            copies then fail at once, or never end when the release did not wake them.
    """

    def __init__(self, parallelize: Parallelize, shard_degree: int | None, buddies: int,
                 timeout: timedelta, released_wait: timedelta) -> None:
        if not callable(parallelize):
            raise TypeError(f"parallelize must be callable, got {type(parallelize).__name__}.")
        if shard_degree is not None and shard_degree < 1:
            raise ValueError(f"shard_degree ({shard_degree}) must be None or >= 1.")
        if buddies < 0:
            raise ValueError(f"buddies ({buddies}) must be >= 0.")
        self._parallelize = parallelize
        self._shard_degree = shard_degree
        self._buddies = buddies
        self._timeout = timeout
        self._released_wait = released_wait
        self._commits = ShardCommits(max_held=1 + buddies)
        self._exchange: BuddyExchange | None = None
        self._copied: ShardCommit | None = None  # the commit whose copies went out last
        self._released: Callable[[], bool] = lambda: False  # whether the round was released
        self._choice: Choice | None = None
        self._layout = (1, 1, 0)  # world, shards, own shard
        self._nodes: list[int] = []  # one node id per rank of the round
        self._group: Any = None  # the round's gloo group for moves and copies
        self._fallback: str | None = None  # what was lost: the next rebuild loads the newest
        # durable checkpoint, and says so once it has
        self._specs: dict[str, TensorSpec] = {}  # this formation's tensors
        self._live: dict[str, torch.Tensor] = {}  # their live local parts on this rank
        self._step_hooks: list[RemovableHandle] = []  # hold the optimizer's next step (and
        # its state dict) until the formation's last pieces landed and its own copy is taken
        self._phases: dict[str, float] = {}  # this formation's seconds, for the rebuilt event
        self.objects: dict[str, Any] = {}
        self.restoring = False  # while parallelize runs: the formation then fills its objects
        self.durable_loader: DurableLoader | None = None
        self.durable_writer: DurableWriter | None = None
        self._imports = AheadImports()

    @property
    def shard_degree(self) -> int | None:
        return self._shard_degree

    # -- the run loop's side --------------------------------------------------------------
    def prepare(self) -> None:
        """As this worker registers: starts the imports of FSDP2's first formation on a thread
        (``sharded_imports``)."""
        self._imports.start()

    def wait_prepared(self, timeout: timedelta) -> None:
        """Waits for ``prepare``'s imports, ``timeout`` at most (before ``run``'s
        ``gc.freeze``, which then takes their objects too)."""
        self._imports.wait(timeout)

    def settle(self) -> None:
        """Before leaving a round: waits for the buddy copies in flight (a failed one leaves
        its commit incomplete, which ``choose`` sees) and drops the round's objects. Once the
        round is released it waits ``released_wait`` more at most and leaves a copy that did
        not end to its thread (it ends with its group's timeout): the release watchdog would
        otherwise restart this worker in place, and its shards would go with it. Lets go of
        the round's side group too: the formation's destroy frees it on a thread of its own
        (``ProcessGroup.destroy``), not the next ``choose`` on this one."""
        self.wait_copies()
        self._group = None
        self._commits.freeze()  # the objects go: a copy-free commit's shards stop moving on
        self.objects = {}
        gc.collect()

    def wait_copies(self) -> None:
        """Waits for the buddy copies in flight (and a reshard's last pieces) as ``settle``
        does, keeping the round's objects: at the job's end, so that no copy is cut off in a
        collective by the process exiting, while ``run()``'s caller may still read them."""
        exchange, self._exchange, self._copied = self._exchange, None, None
        self._drop_step_hooks()
        if exchange is not None:
            try:
                exchange.settle(self._timeout, self._released, self._released_wait)
            except BuddyCopyError as exc:
                log.info("buddy copies of the last commit incomplete: %s", exc)

    def choose(self, topology: Topology, train: TrainState, group: ProcessGroup) -> None:
        """After forming: opens the round's gloo group for the shards' moves and copies (its
        connections join ``group``'s release and failure detection), agrees with every rank
        on the commit to rebuild, and rolls the small state back to its version where that is
        older than this rank's commit.

        Raises:
            ShardedStateLostError: some shard has no live holder and no durable loader is set.
        """
        started = time.monotonic()
        self._released = lambda: group.is_released
        before = group.sockets_now()
        self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        dist.barrier(group=self._group)  # gloo connects lazily: connected before adopting
        group.adopt(before)
        rows = self._gathered_reports(topology.world_size)
        self._nodes = [int(r[0]) for r in rows]
        self._phases = {"choose_s": time.monotonic() - started}
        try:
            self._choice = choose([read_report(r[1:].tolist()) for r in rows])
        except ShardLostError as exc:
            self._choice = None
            self._lost(exc)
            return
        if self._choice is None:
            return
        chosen = (self._choice.version, self._choice.world, self._choice.shards)
        self._commits.rebuilding(chosen)
        held = self._commits.find(chosen)
        if held is not None and train.version != self._choice.version:
            log.warning("rolling back to version %d, the newest commit held whole",
                        self._choice.version)
            train.load_committed(held.small)
        elif held is None and train.version > self._choice.version:
            # a joiner synced to a newer version than the one rebuilt: its small state must
            # come from a holder of the chosen commit, so its own no longer counts as newest
            train.load_committed({"version": 0, "objects": train.committed()["objects"]})

    def _gathered_reports(self, world: int) -> list[torch.Tensor]:
        """Every rank's node id and report row, all as long as the longest (a rank may hold
        many shards under uneven nodes, a joiner none): the width is agreed first."""
        node = zlib.crc32(os.uname().nodename.encode()) & 0x7FFF_FFFF
        report = self._commits.report()  # once: a copy left to its thread may still land
        width = torch.tensor([len(report)], dtype=torch.int64)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=self._group)
        row = torch.cat([torch.tensor([node], dtype=torch.int64),
                         report, torch.full((int(width) - len(report),), -1, dtype=torch.int64)])
        rows = [torch.empty_like(row) for _ in range(world)]
        dist.all_gather(rows, row, group=self._group)
        return rows

    def _lost(self, exc: ShardLostError) -> None:
        if self.durable_loader is None:
            raise ShardedStateLostError(
                f"{exc} Recovering needs a durable sharded checkpoint, and the job has no "
                "checkpoint URL: restart it from scratch, and keep more copies "
                "(ElasticState(buddies=...)) or give it a URL and commit(durable=True).") from exc
        self._fallback = str(exc)

    def rebuild(self, topology: Topology, train: TrainState, events: EventLog,
                group: ProcessGroup, from_durable: bool = False) -> None:
        """Builds this round's objects with ``parallelize``, fills them with the chosen commit
        (resharded) and commits them as this layout's copy of it; the mesh's subgroups join
        ``group``'s release and failure detection; the ``rebuilt`` event times each part.
        ``from_durable``: the small state was synced from a durable checkpoint at this
        formation, so its shards must come from one too."""
        phases, mark = self._phases, time.monotonic()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            phases[name] = phases.get(name, 0.0) + now - mark
            mark = now

        shape = mesh_layout(topology.world_size, self._shard_degree)
        mesh = round_mesh(shape, group)
        self._specs = {}
        self._exchange = BuddyExchange(self._group, topology.rank, topology.world_size,
                                       self._buddies if len(shape) == 1 else 0, self._nodes)
        self._layout = (topology.world_size, shape[-1], topology.rank % shape[-1])
        lap("mesh_s")
        resharding = self._choice is not None and not self._is_durable_newer(train)
        loading = not resharding and self.durable_loader is not None and (
            self._fallback is not None or train.version > 0)
        self.objects = self._build(mesh, resharding or loading)
        lap("parallelize_s")
        resharded = None  # the reshard's new shard, with its host copy when it made one
        if resharding:
            assert self._choice is not None
            resharded = reshard(self._choice, self._commits, *self._model_and_optimizer(),
                                Seat(topology.rank, topology.world_size, self._layout[1],
                                     self._group), events, lap)
        else:  # nothing to check against but each other
            check_built(self._model_and_optimizer()[0], topology.rank, topology.world_size,
                        self._group)
            lap("check_s")
        if loading:
            self._load_durable(train, mesh, from_durable)
            lap("durable_load_s")
        # after a reshard the old layout still holds the commit: its copies in the new one
        # travel while training goes on (the own one too, when the reshard wrote the objects
        # in place); a first formation or a durable load waits for them
        if resharded is None:
            self._commit(train, wait=True)
        else:
            self._commit(train, wait=False, copy=resharded.host_copy, flat=resharded.flat,
                         copy_later=resharded.host_copy is None, landing=resharded.rest)
        lap("commit_s")
        events.emit("rebuilt", to_world=topology.world_size, **phases)
        self._phases = {}

    def _load_durable(self, train: TrainState, mesh: DeviceMesh, from_durable: bool) -> None:
        """Fills the objects from the newest durable sharded checkpoint, when nobody holds a
        commit of the shards yet the state is at one: a resume, the fallback after a lost
        shard, or a durable checkpoint newer than every commit held whole (restored entire).
        Raises ``ShardedStateLostError`` when none stands in for what was lost."""
        assert self.durable_loader is not None
        lost, self._fallback = self._fallback, None
        small = self.durable_loader(self.objects, lost is not None)
        if small is not None:
            train.load_committed(small)
            train.restore()
            if lost is not None:
                log.warning("%s Resumed from the newest durable sharded checkpoint "
                            "(version %d): the steps since it are lost.", lost, train.version)
        elif lost is not None:  # else a fresh model would train on under the commit's step
            raise ShardedStateLostError(
                f"{lost} The checkpoint URL holds no durable sharded checkpoint to resume "
                "from: restart the job from scratch, and keep more copies "
                "(ElasticState(buddies=...)) or commit(durable=True) early.")
        elif self._choice is not None or from_durable:  # else the shards would start fresh
            # under the step and sampler of the checkpoint the small state came from
            raise ShardedStateLostError(
                f"the durable sharded checkpoint of version {train.version} that the small "
                "state was synced from could not be loaded for its shards, and no older one "
                "verifies (see the warnings above): check that the checkpoint URL is readable "
                "and was not pruned meanwhile, or restore its files; to start over, give the "
                "job a new checkpoint URL.")
        else:  # nothing filled the objects built as ``restoring``: built anew
            self.objects = {}
            gc.collect()  # the first build's memory goes before the second's comes
            self.objects = self._build(mesh, restoring=False)

    def _build(self, mesh: DeviceMesh, restoring: bool) -> dict[str, Any]:
        """The user's ``parallelize(mesh)``, with ``restoring`` set while it runs."""
        self.restoring = restoring
        try:
            return self._built(self._parallelize(mesh))
        finally:
            self.restoring = False

    def _is_durable_newer(self, train: TrainState) -> bool:
        """Whether the small state synced at this formation is a durable checkpoint's newer
        than the chosen commit (rank 0 read it; every rank holds its version now): then that
        checkpoint is the newest consistent state, and its shards are loaded with it."""
        assert self._choice is not None
        if train.version <= self._choice.version:
            return False
        log.warning("the durable checkpoint of version %d is newer than the newest commit held "
                    "whole in memory (version %d): restoring it, shards and all",
                    train.version, self._choice.version)
        return True

    # -- commits ----------------------------------------------------------------------------
    def before_commit(self) -> None:
        """Waits for the last commit's buddy copies: the commit after it starts only once it
        is held whole.

        Raises:
            PeerFailureError: a copy failed (a peer died); the run loop re-forms.
        """
        exchange = self._exchange
        if exchange is None:
            return
        try:
            exchange.wait(self._timeout)
        except BuddyCopyError as exc:
            raise PeerFailureError(str(exc)) from exc
        finally:
            self._drop_step_hooks()

    def confirm_copies(self) -> None:
        """An agreement that followed ``before_commit`` on every rank was reached: the copies
        each rank waited for there are held everywhere, so their commit is whole."""
        copied, self._copied = self._copied, None
        if copied is not None:
            self._commits.confirm(copied)

    def commit(self, train: TrainState, send_copies: Callable[[], bool] = lambda: True) -> None:
        """Copies this rank's shards of the live objects to host memory as the commit of
        ``train.version`` and, when ``send_copies()`` says so once the copy is taken, starts
        sending them to the buddies (without: only their owners hold them)."""
        self._commit(train, wait=False, send=send_copies)

    def commit_live(self, train: TrainState) -> None:
        """The copy-free commit of ``train.version``: this rank's live shards are the commit
        (valid until the next step is applied); nothing is copied or sent."""
        world, shards, own = self._layout
        self._commits.add(ShardCommit(train.version, world, shards, own, self._specs,
                                      snapshot(train.committed()), {own: self._stable_live()},
                                      live=True))

    def can_commit_live(self) -> bool:
        """Whether this rank's live shards may serve as a commit that nothing steps again (a
        join's): they are in host memory (not on a GPU), and the live tensors recorded at the
        last commit still hold every parameter and optimizer state tensor of the objects,
        none created or replaced since (a new parameter group, a state dict loaded by the
        user): a check by address, with no state dict taken."""
        if not self._live or not all(t.device.type == "cpu" for t in self._live.values()):
            return False
        return hold_every_tensor(self._live, *self._model_and_optimizer())

    def _commit(self, train: TrainState, wait: bool, copy: dict[str, torch.Tensor] | None = None,
                send: Callable[[], bool] = lambda: True,
                flat: dict[str, torch.Tensor] | None = None, copy_later: bool = False,
                landing: Callable[[], None] | None = None) -> None:
        """Commits this rank's shards of the live objects and sends them to the buddies.

        Args:
            copy: a host copy of those shards made already (a formation's reshard).
            flat: the objects' state by flat name, when the caller took it already.
            copy_later: after a reshard written into the live objects in place: the
                exchange's thread copies them to host memory before sending them, while the
                first step runs up to its optimizer step, which waits for that copy (a hook).
                Until the copy lands the commit holds no shard of its own (none is reported),
                and a failure rebuilds from the old layout's copy of the same version.
            landing: with ``copy_later``: lands the reshard's deferred pieces (the
                optimizer's moments) into the live objects, on that thread, before the copy.
        """
        self._take_live(flat)
        world, shards, own = self._layout
        held = {} if copy_later else {own: host_copy(self._live, self._commits.buffers)
                                      if copy is None else copy}
        commit = ShardCommit(train.version, world, shards, own, self._specs,
                             snapshot(train.committed()), held)
        self._commits.add(commit)
        exchange = self._exchange
        assert exchange is not None
        if wait:
            try:
                exchange.exchange(commit, self._commits)
            except RuntimeError as exc:
                raise PeerFailureError(f"buddy copies at formation failed: {exc}") from exc
            self._copied = commit
        elif copy_later or send():
            exchange.start(commit, self._commits,
                           own_from=self._stable_live() if copy_later else None,
                           landing=landing if copy_later else None)
            self._copied = commit
        if copy_later:
            timeout = self._timeout

            def wait_own(*_: Any) -> None:
                try:
                    exchange.wait_own(timeout)
                except BuddyCopyError as exc:
                    raise PeerFailureError(str(exc)) from exc

            self._step_hooks = waits_first(self._model_and_optimizer()[1], wait_own)

    def _drop_step_hooks(self) -> None:
        hooks, self._step_hooks = self._step_hooks, []
        for hook in hooks:
            hook.remove()

    def _stable_live(self) -> dict[str, torch.Tensor]:
        """The live local tensors as a commit may hold them while training goes on: those
        only ``optimizer.step()`` writes (parameters, optimizer state) as they are, the
        module's buffers (a forward writes them: batch norm's statistics) copied now."""
        return {name: tensor.clone() if name.startswith(MODEL) and not self._specs[name].sharded
                else tensor for name, tensor in self._live.items()}

    def _take_live(self, flat: dict[str, torch.Tensor] | None) -> None:
        """Records the live local tensors (``optimizer.step()`` updates them in place) and the
        formation's specs, from ``flat`` or a state dict taken now."""
        if flat is None:
            flat = flat_tensors(*sharded_state_dict(*self._model_and_optimizer()))
        if flat.keys() != self._specs.keys():  # a formation's shapes stay until the next
            self._specs = {name: spec_of(value) for name, value in flat.items()}
        self._live = {name: local_part(value).detach() for name, value in flat.items()}

    def write_durable(self, train: TrainState) -> None:
        """Hands this rank's shards of the commit just taken to the durable writer hook (set
        whenever there is a checkpoint URL)."""
        assert self.durable_writer is not None, "no checkpoint URL: nothing to write to"
        model_sd, optim_sd = self.state_dict()
        self.durable_writer(train.version, {"model": model_sd, "optimizer": optim_sd},
                            snapshot(train.committed()))

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The current formation's model and optimizer state dicts, sharded (DTensors), from
        ``torch.distributed.checkpoint.state_dict.get_state_dict``."""
        return sharded_state_dict(*self._model_and_optimizer())

    def _built(self, objects: Any) -> dict[str, Any]:
        if not isinstance(objects, dict) or not all(isinstance(k, str) for k in objects):
            raise TypeError("parallelize(mesh) must return a dict of named objects, e.g. "
                            "{'model': model, 'optimizer': optimizer}; it returned "
                            f"{type(objects).__name__}.")
        return objects

    def _model_and_optimizer(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        models = [o for o in self.objects.values() if isinstance(o, torch.nn.Module)]
        optimizers = [o for o in self.objects.values() if isinstance(o, torch.optim.Optimizer)]
        if len(models) != 1 or len(optimizers) != 1:
            raise TypeError("parallelize(mesh) must return exactly one nn.Module and one "
                            f"optimizer; it returned {sorted(self.objects)}.")
        return models[0], optimizers[0]


def waits_first(optimizer: torch.optim.Optimizer, wait: Callable[..., None]
                ) -> list[RemovableHandle]:
    """Has ``optimizer.step()``, ``state_dict()`` and ``load_state_dict()`` call ``wait`` before
    anything else reads or writes the optimizer's state through them: before the pre-hooks
    registered earlier (a user's, in ``parallelize``) too. Torch's step pre-hooks take no
    ``prepend``: the hook is moved to the front of their ordered dict."""
    step = optimizer.register_step_pre_hook(wait)
    optimizer._optimizer_step_pre_hooks.move_to_end(step.id, last=False)
    return [step, optimizer.register_state_dict_pre_hook(wait, prepend=True),
            optimizer.register_load_state_dict_pre_hook(wait, prepend=True)]
