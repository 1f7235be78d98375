"""The durable side of a sharded job: every rank's shards to the checkpoint URL at
``commit(durable=True)``, and the newest durable sharded checkpoint into a new formation.

Owns the two hooks of ``ShardedRuntime`` (``durable_writer``, ``durable_loader``) and how they
use the job's ``DurableCommits`` (its store, fencing token, lease check and failure records).
The format, the checksums and the N -> M resharding at load are ``checkpoint.ShardedCheckpoints``'
(DCP's planner); this module never moves shards itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastic.checkpoint import CheckpointError, CheckpointNotFoundError, ShardedCheckpoints
from elastic.durable import DurableCommits
from elastic.foundation.errors import EtcdUnavailableError, FencingContestedError
from elastic.foundation.events import EventLog
from elastic.state.sync import transport_device
from elastic.state.sharded.optimizer_state import make_state

log = logging.getLogger(__name__)


class ShardedDurable:
    """Writes and loads one sharded job's durable checkpoints; every call is collective.

    Args:
        durable: the job's durable commits (store, fencing, failure records).
        events: where writes and loads are recorded.
        metadata: returns the manifest metadata of a commit (epoch, world size, member).
    """

    def __init__(self, durable: DurableCommits, events: Callable[[], EventLog | None],
                 metadata: Callable[[], dict[str, Any]]) -> None:
        self._durable = durable
        self._events = events
        self._metadata = metadata

    def write(self, version: int, state: dict[str, Any], payload: dict[str, Any]) -> None:
        """Writes this rank's shards of commit ``version`` (and rank 0 the payload); a failure
        is recorded as for replicated commits, and training goes on."""
        started = time.monotonic()
        shards = ShardedCheckpoints(self._durable.store)  # the round's (default) group
        try:
            meta, failed = self._durable.publish_metadata(self._metadata()), None
        except (CheckpointError, EtcdUnavailableError, FencingContestedError) as exc:
            meta, failed = {}, exc  # on the rank armed with the fencing token only
        if not _on_every_rank(failed is None):  # or the others would wait in the save for it
            self._durable.record_failure(version, failed or CheckpointError(
                "the rank that publishes could not ready the write (see its log); the next "
                "durable commit tries again."))
            return
        try:
            ref = shards.save(version, state, meta, self._durable.before_publish, payload)
        except (CheckpointError, EtcdUnavailableError, FencingContestedError) as exc:
            self._durable.record_failure(version, exc)
            return
        self._durable.written += 1
        events = self._events()
        if events is not None:
            events.emit("checkpoint_written", version=version, url=ref.url, sharded=True,
                        blocked_s=time.monotonic() - started,
                        write_s=time.monotonic() - started)

    def load(self, objects: dict[str, Any], lost: bool = False) -> dict[str, Any] | None:
        """Fills the new formation's model and optimizer from the newest durable sharded
        checkpoint (resharded by DCP to this world size). None found is an info line at a first
        start (nothing written yet); when ``lost`` (some shard of the last commit had no live
        holder) the caller stops the job instead.

        Returns:
            The checkpoint's payload (the committed small state), or None when there is none.
        """
        model, optimizer = objects["model"], objects["optimizer"]
        make_state(optimizer)  # as torch's zero-gradient step would leave it, without the step
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        try:
            loaded = ShardedCheckpoints(self._durable.store).load(state)
        except CheckpointNotFoundError:
            if not lost:
                log.info("no durable sharded checkpoint under %s yet: the model and optimizer "
                         "start as parallelize(mesh) built them.", self._durable.url)
            return None
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        events = self._events()
        if events is not None:
            events.emit("checkpoint_loaded", version=loaded.ref.step, url=loaded.ref.url,
                        epoch=loaded.ref.epoch, sharded=True,
                        from_world=loaded.ref.world_size)
        return loaded.state_dict


def _on_every_rank(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of the round's (default) group; collective."""
    flag = torch.tensor([int(ok)], dtype=torch.int64, device=transport_device(None))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
