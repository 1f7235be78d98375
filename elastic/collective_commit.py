"""The collective commit of ``ElasticState``: ``commit``, ``commit_step``, ``check_membership``.

A mixin of ``ElasticState`` (``elastic_state``), kept apart so that each module stays one
concept: the state owns the registered objects, the topology and ``run``; this owns what one
commit does on every rank (the membership agreement, voted once the step's collectives
completed; the snapshot, or the live step; the progress event; the durable write on rank 0,
or every rank's shards) and the durable side's public face (``checkpoint_error``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from elastic.agreement import MembershipAgreement
from elastic.cluster.cluster import Cluster
from elastic.durable import DurableCommits
from elastic.loop_helpers import BatchInHand, samples_done
from elastic.sharded import ShardedRuntime
from elastic.state import StateError, TrainState
from elastic.step_collectives import StepCollectives

log = logging.getLogger(__name__)


class CollectiveCommit:
    """The commit side, for ``ElasticState``, which sets these attributes and ``rank``,
    ``world_size`` and ``member_id``."""

    _train: TrainState
    _cluster: Cluster | None
    _durable: DurableCommits | None
    _sharded: ShardedRuntime | None
    _step_collectives: StepCollectives
    _batch_in_hand: BatchInHand
    _leave_requested: threading.Event
    _warned_not_durable: bool
    _progress_at: float | None
    _progress_every_s: float
    rank: int
    world_size: int
    member_id: str | None

    def commit(self, durable: bool = False) -> int:
        """Snapshots every object in host memory and agrees with all ranks on membership.

        Collective: every rank calls it at the same point. The agreement (two flags per rank,
        gathered by rank 0 over the round's ``AgreementChannel``) is started first and travels
        while the snapshot is copied. With sharded state on the CPU, a rank that knows of a
        pending join waits for the agreement first: at a join its live shards are the commit
        and are not copied (docs/sharded.md). If a join or leave is pending, the commit is kept and
        ``MembershipChangedInterrupt`` hands over to the run loop, which re-forms the group and
        calls the training function again (no work is lost).

        Args:
            durable: also write the commit to the checkpoint URL (rank 0, in the background).

        Returns:
            The new commit version.

        Raises:
            MembershipChangedInterrupt: the world changes now (caught by ``run``).
            LeaveInterrupt: this worker was asked to leave and the others know it.
            PeerFailureError: a peer failed during the agreement (caught by ``run``).
            FencedError: this member lost its lease (caught by ``run``).
        """
        if self._cluster is not None:
            self._cluster.membership.check_not_fenced()
        if self._sharded is not None:
            self._sharded.before_commit()  # the last commit's buddy copies have landed
        agreement = self._start_agreement()
        version = self._train.commit()
        if self._sharded is not None and self._join_agreed(agreement, durable):
            self._sharded.commit_live(self._train)  # the join's reshard reads the live shards
        elif self._sharded is not None:
            self._sharded.commit(self._train, send_copies=lambda: self._copies_wanted(agreement))
        if durable:
            self._commit_durably(version)
        self._committed(version, agreement)
        return version

    @contextlib.contextmanager
    def commit_step(self) -> Iterator[None]:
        """The copy-free commit: every rank applies the step in the block, or none does.

        Use it around ``optimizer.step()`` and the rest of the step's bookkeeping, after the
        backward pass (whose gradient all-reduce is the step's last collective)::

            loss.backward()
            with state.commit_step():
                optimizer.step()
                state.sampler.record_batch(len(x))
                state.step += 1

        On entry, the membership agreement of ``commit()`` is taken, each rank voting only once
        its step's collectives completed (``track_collective``): reaching it means every rank's
        collectives of this step succeeded. If a peer failed, the block is
        skipped on every rank (``PeerFailureError``), so the parameters and optimizer state
        were never half-updated: they are the rollback point themselves, and are not copied.
        On leaving the block, everything else registered (sampler, plain values, schedulers,
        module buffers, the optimizers' hyper-parameters: small) is recorded as by
        ``commit()`` and the version grows by one. A pending join or leave is then acted on,
        after the step (no work is lost). At re-formation the rank with the newest version
        broadcasts its live state. The block must not run collectives; state that the loop
        changes between two blocks rolls back to its value at the end of the last block.

        Raises:
            PeerFailureError: a peer failed before the step was agreed (caught by ``run``).
            MembershipChangedInterrupt: after the step: the world changes now.
            LeaveInterrupt: after the step: this worker leaves and the others know it.
            FencedError: this member lost its lease (caught by ``run``).
            StateError: no optimizer is registered (use ``commit()``).

        With sharded state (``parallelize``) the live shards are the commit and are not
        copied: under HSDP the replicas hold each shard; under pure FSDP a rank's death rolls
        back to the last ``commit()`` (whose shards have buddy copies), see docs/sharded.md.
        """
        if self._cluster is not None:
            self._cluster.membership.check_not_fenced()
        if self._sharded is not None:
            self._sharded.before_commit()
        agreement = self._start_agreement()
        if agreement is not None:
            agreement.wait()  # a failed peer ends the step here, on every rank
            if self._sharded is not None:
                self._sharded.confirm_copies()  # every rank waited for them before voting
        yield
        self._batch_in_hand.record()  # a batches() loop's batch: this step trained it
        if self._sharded is None:
            self._committed(self._train.commit_live(), agreement)
            return
        version = self._train.commit()  # the small state; the shards are live
        self._sharded.commit_live(self._train)
        self._committed(version, agreement)

    def _join_agreed(self, agreement: MembershipAgreement | None, durable: bool) -> bool:
        """Whether this sharded commit may be the live shards themselves: the world re-forms
        now with no rank leaving by request (a join; or a member lost, whose shard then has
        no holder, and the re-formation rolls back to the last whole commit, as it would
        from a copy that no buddy received), so nothing steps them again before the
        re-formation's reshard has read them, and their host copy would only lengthen the
        pause. Only where this worker voted for the change (otherwise the copy travels while
        the agreement does, as usual), the live shards are in host memory and current (a
        GPU's copy frees the device for the new layout; see ``can_commit_live``) and the
        commit is not durable (its writer reads them later). Waits for the agreement to
        decide."""
        assert self._sharded is not None
        if (durable or agreement is None or not agreement.saw_change
                or not self._sharded.can_commit_live() or not agreement.is_reached()):
            return False
        self._sharded.confirm_copies()  # every rank waited for them before voting
        return agreement.is_change_without_leavers()

    def _copies_wanted(self, agreement: MembershipAgreement | None) -> bool:
        """Once this commit's agreement is reached: the last commit's buddy copies are whole
        (every rank waited for them before voting), and whether this one's go out. Not when it
        agrees on a join: every holder of its shards takes part in the next round, and sending
        them first would only delay it; the last whole commit is kept meanwhile."""
        if agreement is None or not agreement.is_reached():
            return True
        assert self._sharded is not None
        self._sharded.confirm_copies()
        return not agreement.is_change_without_leavers()

    def check_membership(self) -> None:
        """The membership agreement of ``commit()`` without a snapshot.

        Raises:
            MembershipChangedInterrupt: the world changes now.
            LeaveInterrupt: this worker was asked to leave and the others know it.
            PeerFailureError: a peer failed during the agreement.
        """
        agreement = self._start_agreement()
        if agreement is not None:
            agreement.finish()

    def _committed(self, version: int, agreement: MembershipAgreement | None) -> None:
        """After a commit counts: progress, the agreement's outcome (it may interrupt), and the
        launcher told that this worker committed."""
        self._report_progress(version)
        if self._cluster is not None:
            self._cluster.note_committed()
        if agreement is not None:
            agreement.finish()

    def _start_agreement(self) -> MembershipAgreement | None:
        """Votes once this step's collectives completed; None when not in a formed group."""
        cluster = self._cluster
        if cluster is None or cluster.topology is None:
            return None
        self._step_collectives.wait(cluster.group.device_index,
                                    lambda: cluster.group.is_released, cluster.group.timeout,
                                    cluster.settings.timeouts.wake)
        return MembershipAgreement.start(cluster, self._leave_requested)

    def _report_progress(self, version: int) -> None:
        """Rank 0 records a ``progress`` event (with ``step`` when registered) twice a second
        at most, for ``elastic report``'s steps/s."""
        cluster = self._cluster
        now = time.monotonic()
        if cluster is None or self.rank != 0 or (
                self._progress_at is not None and now - self._progress_at < self._progress_every_s):
            return
        self._progress_at = now
        step = self._train.value_of("step")
        fields = {"step": step} if isinstance(step, int) and not isinstance(step, bool) else {}
        fields.update(samples_done(self._train))
        cluster.events.emit("progress", version=version, **fields)

    @property
    def checkpoint_error(self) -> Exception | None:
        """The last failed durable write, if any (training goes on; the previous one is valid)."""
        return self._durable.last_error if self._durable else None

    def sharded_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The current formation's model and optimizer state dicts as DTensors (torch's
        ``get_state_dict``), for a durable sharded writer.

        Raises:
            StateError: the state is not sharded (no ``parallelize``).
        """
        if self._sharded is None:
            raise StateError("sharded_state_dict() needs ElasticState(parallelize=...).")
        return self._sharded.state_dict()

    def _commit_durably(self, version: int) -> None:
        """Has rank 0 write the commit to the checkpoint URL in the background (sharded: every
        rank hands its shards to the durable writer hook)."""
        if self._durable is None:
            if not self._warned_not_durable:
                log.warning("commit(durable=True) without a checkpoint URL: the commit stays in "
                            "memory. Pass ElasticState(checkpoint=URL), --checkpoint or "
                            "ELASTIC_CHECKPOINT to make it durable.")
                self._warned_not_durable = True
            return
        if self._sharded is not None:
            self._sharded.write_durable(self._train)
        elif self.rank == 0:
            self._durable.write(self._train.committed(), version, self._commit_metadata())

    def _commit_metadata(self) -> dict[str, Any]:
        """The manifest metadata of a durable commit: world size, member, epoch."""
        epoch = self._train.value_of("epoch")
        metadata: dict[str, Any] = {"world_size": self.world_size,
                                    "member": self.member_id or ""}
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            metadata["epoch"] = epoch
        return metadata
