"""``TrainState``: the named objects of a training job, committed and restored together.

Owns the registry of named objects (Stateful objects and plain values), the in-memory
commit (one snapshot path, to CPU), rollback, the collective ``sync`` from one rank, and
the thin hand-off to a durable store. Must not import ``elastic`` or ``checkpoint``: a store
is any object with ``save(step, state_dict, metadata)`` and ``load(ref)``.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from elastic.state.errors import NoCommitError, StateError, StateKeyError
from elastic.state.feed import feed_payload
from elastic.state.half_step import reset_half_step
from elastic.state.landing import landing_tree, load_fed
from elastic.state.payload import payload_parts
from elastic.state.live_commit import (fill_live, holds_live, is_optimizer,
                                       live_tensor_addresses, mark_live, require_optimizers)
from elastic.state.plain_values import check_plain, restore_value
from elastic.state.stateful import is_stateful, snapshot

__all__ = ["TrainState"]

class TrainState:
    """Named training objects with an in-memory commit, rollback and broadcast.

    Keyword objects are either Stateful (``state_dict``/``load_state_dict``: a module,
    optimizer, LR scheduler, GradScaler, ``ElasticSampler``, your own) or plain values
    (int, float, str, bool, None, tensors, dicts/lists/tuples of them). Every registered
    object reads as an attribute (``state.model``); plain values also write as attributes
    (``state.epoch += 1``). Setting an unregistered public name raises AttributeError
    (catching typos); names of methods and properties cannot be registered.

    Construction does not commit: call ``commit()`` for the first rollback point.

    Example:
        >>> state = TrainState(model=model, optimizer=opt, epoch=0)
        >>> state.epoch += 1
        >>> state.commit()
        1
    """

    def __init__(self, **objects: Any) -> None:
        self._storage: dict[str, Any] | None = None  # None: this instance's own __dict__
        self._stateful: dict[str, Any] = {}
        self._value_names: dict[str, None] = {}  # an ordered set; the values sit in storage
        self._commit: dict[str, Any] | None = None
        self._live: frozenset[str] = frozenset()  # names whose commit holds LIVE markers
        self._version = 0
        self._unsettled = False  # a sync into the live objects failed: restore() them
        for name, obj in objects.items():
            self.register(name, obj)

    # -- the attribute routing: the one place plain values become attributes ---------------
    # Every registered object lives in the instance ``__dict__`` under its name (or in the
    # ``__dict__`` of the object it is ``stored_in``), so reading it is a plain attribute read
    # (a training loop reads ``state.step`` several times a step; going through ``__getattr__``
    # costs a failed lookup and a Python call per read). ``_stateful`` and ``_value_names`` say
    # which names are registered and of which kind.

    @classmethod
    def stored_in(cls, storage: dict[str, Any]) -> "TrainState":
        """An empty TrainState whose registered objects live in ``storage``.

        ``storage`` is the ``__dict__`` of the object that holds this state (``ElasticState``),
        so that the registered names read as that object's own plain attributes.
        """
        state = cls()
        state._storage = storage
        return state

    def _objects(self) -> dict[str, Any]:
        """Where the registered objects live, by name."""
        storage = self.__dict__["_storage"]
        return self.__dict__ if storage is None else storage

    def __getattr__(self, name: str) -> Any:
        # Called only when normal lookup fails: the name is not registered here, or it lives
        # in another object's storage.
        own = self.__dict__
        if name in own.get("_stateful", ()) or name in own.get("_value_names", ()):
            return self._objects()[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or registered object {name!r}.")

    def __setattr__(self, name: str, value: Any) -> None:
        registry = self.__dict__
        if name in registry.get("_value_names", ()):
            check_plain(name, value)  # here, not at the first re-formation that sends it
            self._objects()[name] = value
        elif name.startswith("_") or isinstance(getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)
        elif name in registry.get("_stateful", ()):
            raise AttributeError(f"{name!r} is a registered Stateful object and cannot be replaced; "
                                 f"load new state into it with load_state_dict().")
        else:
            raise AttributeError(f"{name!r} is not a registered value of this {type(self).__name__}; "
                                 f"call register({name!r}, value) first.")

    def __delattr__(self, name: str) -> None:
        registry = self.__dict__
        if name in registry.get("_value_names", ()) or name in registry.get("_stateful", ()):
            raise AttributeError(f"{name!r} is registered and cannot be deleted; assign a new "
                                 f"value instead (plain values) or load new state into it.")
        object.__delattr__(self, name)

    def _plain_values(self) -> dict[str, Any]:
        """The registered plain values by name, in registration order."""
        objects = self._objects()
        return {name: objects[name] for name in self._value_names}

    def value_of(self, name: str) -> Any:
        """The registered plain value ``name``, or None when no plain value has that name."""
        return self._objects()[name] if name in self._value_names else None

    def stateful_objects(self) -> dict[str, Any]:
        """The registered Stateful objects by name, in registration order."""
        return dict(self._stateful)

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is registered (a Stateful object or a plain value)."""
        return name in self._stateful or name in self._value_names

    def register(self, name: str, obj: Any) -> None:
        """Adds a named Stateful object or plain value.

        Args:
            name: A Python identifier, not starting with ``_``, not already registered and
                not the name of a method or property of this class.
            obj: A Stateful object or a plain value.

        Raises:
            ValueError: The name is invalid, reserved or already registered.
            TypeError: ``obj`` is neither Stateful nor a plain value.
        """
        if not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"name {name!r} must be an identifier that does not start with '_'.")
        if hasattr(type(self), name):
            raise ValueError(f"name {name!r} clashes with {type(self).__name__}.{name}; choose another name.")
        if name in self._stateful or name in self._value_names:
            raise ValueError(f"name {name!r} is already registered.")
        # New registries rather than in-place updates: a shallow copy of this state that
        # registers a name must not add it to the original's registry (its __dict__ lacks it).
        if is_stateful(obj):
            self._stateful = {**self._stateful, name: obj}
        else:
            check_plain(name, obj)
            self._value_names = {**self._value_names, name: None}
        self._objects()[name] = obj

    @property
    def names(self) -> tuple[str, ...]:
        """Names of all registered objects, Stateful first, in registration order."""
        return tuple(self._stateful) + tuple(self._value_names)

    # -- commit and rollback -----------------------------------------------------------------

    @property
    def version(self) -> int:
        """Version of the current commit; 0 before the first commit."""
        return self._version

    @property
    def has_commit(self) -> bool:
        """Whether a commit exists to restore, save or broadcast."""
        return self._commit is not None

    @property
    def unsettled(self) -> bool:
        """Whether a failed sync left the live objects half-written (until ``restore()``)."""
        return self._unsettled

    def commit(self) -> int:
        """Snapshots every registered object to CPU host memory as the new rollback point.

        The previous commit is overwritten in place where its structure, shapes and dtypes
        match (see ``state.stateful.snapshot``), so a steady loop's commit does not allocate.

        Returns:
            The new version (the previous one plus 1).

        Raises:
            StateError: Copying failed; the previous commit is then dropped, since its
                buffers may be half overwritten.
        """
        return self._record({name: obj.state_dict() for name, obj in self._stateful.items()})

    def commit_live(self) -> int:
        """The copy-free commit: records everything but the tensors the optimizers own.

        The registered optimizers' parameters and optimizer state (what ``optimizer.step()``
        writes) are not copied: the live tensors are the commit. All else (module buffers,
        hyper-parameters, sampler, schedulers, plain values: small) is copied as by
        ``commit()``. Valid right after a step that every rank applies or none does
        (``ElasticState.commit_step``), while nothing else changes those tensors.

        Returns:
            The new version (the previous one plus 1).

        Raises:
            StateError: No optimizer is registered, or copying failed (the previous commit
                is then dropped).
        """
        optimizers = [obj for obj in self._stateful.values() if is_optimizer(obj)]
        require_optimizers(optimizers)
        live = live_tensor_addresses(optimizers)
        return self._record({name: mark_live(obj.state_dict(), live)
                             for name, obj in self._stateful.items()})

    def _record(self, states: dict[str, Any]) -> int:
        """Snapshots ``states`` and the plain values as the new commit; returns its version."""
        states.update(self._plain_values())
        self._live = frozenset()
        try:
            self._commit = snapshot(states, self._commit)
        except (RuntimeError, TypeError, ValueError) as exc:
            self._commit = None
            raise StateError(f"commit of version {self._version + 1} failed; "
                             f"no commit is left to restore: {exc}") from exc
        self._live = frozenset(name for name in self._stateful if holds_live(self._commit[name]))
        self._version += 1
        return self._version

    def restore(self) -> None:
        """Loads the current commit back into the live objects (rollback).

        Stateful objects get ``load_state_dict`` of a fresh copy (so the commit stays
        untouched by later training); plain-value tensors go back to the device of the live
        tensor they replace. What the state dicts do not carry is reset too (``half_step``):
        every GradScaler's per-optimizer stage, and every registered parameter's ``.grad``.

        Raises:
            NoCommitError: There is no commit.
            StateKeyError: The commit's names differ from the registered ones.
        """
        if self._commit is None:
            raise NoCommitError("restore() needs a commit; call commit() first.")
        self._check_names(self._commit)
        self._unsettled = False
        for name, obj in self._stateful.items():
            saved = self._commit[name]
            if name in self._live:  # its live tensors are the commit: loaded onto themselves
                obj.load_state_dict(fill_live(saved, obj.state_dict(), copy=True, path=name))
            else:
                obj.load_state_dict(snapshot(saved))
        reset_half_step(self._stateful.values())
        objects = self._objects()
        for name in self._value_names:
            objects[name] = restore_value(self._commit[name], objects[name])

    def committed(self) -> dict[str, Any]:
        """Returns the current commit as ``{"version": int, "objects": {name: state}}``.

        The objects' state dicts are the commit's own (CPU tensors and containers), not
        copies, and after ``commit_live()`` its live tensors are the objects' own: a caller
        that keeps the payload across a commit or a step (an asynchronous writer) copies it.

        Raises:
            NoCommitError: There is no commit.
        """
        if self._commit is None:
            raise NoCommitError("committed() needs a commit; call commit() first.")
        objects = dict(self._commit)
        for name in self._live:  # a copy-free commit: the live tensors, not copies
            objects[name] = fill_live(objects[name], self._stateful[name].state_dict(),
                                      copy=False, path=name)
        return {"version": self._version, "objects": objects}

    def load_committed(self, payload: Mapping[str, Any]) -> None:
        """Installs ``payload`` (from ``committed()``) as the current commit.

        The payload is copied to CPU; call ``restore()`` to apply it to the live objects.

        Args:
            payload: ``{"version": int, "objects": {name: state}}``.

        Raises:
            StateKeyError: The payload's keys or object names do not match.
        """
        version, objects = self._validated(payload)
        self._commit, self._live = {name: snapshot(s) for name, s in objects.items()}, frozenset()
        self._version = version

    def _validated(self, payload: Mapping[str, Any]) -> tuple[int, Mapping[str, Any]]:
        """The version and objects of a payload, or StateKeyError."""
        version, objects = payload_parts(payload)
        self._check_names(objects)
        return version, objects

    def _check_names(self, objects: Mapping[str, Any]) -> None:
        """Raises StateKeyError unless ``objects`` names exactly the registered objects."""
        missing = sorted(set(self.names) - set(objects))
        unknown = sorted(set(objects) - set(self.names))
        if missing or unknown:
            raise StateKeyError(f"committed state does not match the registered objects: "
                                f"missing {missing}, unknown {unknown}.")

    # -- moving the commit -------------------------------------------------------------------

    def sync(
        self,
        src_rank: int,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
        receivers: Sequence[int] | None = None,
    ) -> int:
        """Makes the commit of ``src_rank`` the commit of every receiver, then restores it.

        Collective over the source and the receivers; every rank of ``group`` may call it with
        the same arguments, and a rank that is neither only restores its own commit (it must
        hold the source's very commit already: ``newest_source`` names who does not). The source
        sends a small skeleton, then its tensors point to point along a chain of the receivers
        (``state.feed``), which build the payload from it (their own structure does not matter).
        A receiver holding a commit takes large tensors into its modules' and optimizers' own
        (``state.landing``); a failed transfer leaves them half-written (``unsettled``).

        Args:
            src_rank: Rank within ``group`` whose commit wins.
            group: The process group; None means the default group.
            timeout: Bound on each message; None uses the group's timeout.
            receivers: Ranks within ``group`` that take the source's commit; None means all.

        Returns:
            The bytes of state this rank sent or received (0: it took no part).

        Raises:
            NoCommitError: The source has no commit (raised on the source and every receiver).
            SyncError: Sending or receiving failed or timed out.
            StateKeyError: The source's objects differ from the registered ones.
        """
        is_src = dist.get_rank(group) == src_rank
        if receivers is not None and set(receivers) <= {src_rank}:  # every rank holds it
            self.restore()
            return 0
        payload = self.committed() if is_src and self.has_commit else None
        into = landing_tree(self._stateful, self._live) if self.has_commit and not is_src else None
        self._unsettled = into is not None  # until the transfer ended well
        fed = feed_payload(payload, src_rank, receivers, group, timeout=timeout, into=into)
        self._unsettled = False
        if fed.payload is None and fed.nbytes:
            raise NoCommitError(f"sync() from rank {src_rank}: that rank has no commit.")
        if fed.nbytes and not is_src:
            self._take(fed.payload)
        else:
            self.restore()
        return fed.nbytes

    def _take(self, payload: Mapping[str, Any]) -> None:
        """Commits a copy of a fed payload, then loads the payload into the live objects."""
        version, objects = self._validated(payload)
        previous, self._commit, self._live = self._commit, None, frozenset()
        try:
            self._commit, self._version = snapshot(dict(objects), previous), version
        except (RuntimeError, TypeError, ValueError) as exc:
            raise StateError(f"committing synced state (version {version}) failed: {exc}") from exc
        load_fed(self._stateful, objects)  # they may keep or change it: nothing else holds it
        live = self._objects()
        for name in self._value_names:
            live[name] = restore_value(objects[name], live[name])

    def save(self, store: Any, step: int | None = None, metadata: dict[str, Any] | None = None) -> Any:
        """Writes the current commit to a durable store.

        Args:
            store: Any object with ``save(step, state_dict, metadata)``.
            step: Step to save under; defaults to the commit's version.
            metadata: Extra metadata for the store.

        Returns:
            Whatever ``store.save`` returns.

        Raises:
            NoCommitError: There is no commit; call commit() before save().
        """
        if self._commit is None:
            raise NoCommitError("commit() before save(): there is no commit to write.")
        return store.save(self._version if step is None else step, self.committed(), metadata)

    def load(self, store: Any, ref: Any = None) -> Any:
        """Reads a commit from a durable store, installs it and restores it.

        Args:
            store: Any object with ``load(ref)`` returning an object whose ``state_dict``
                attribute is a payload of ``committed()`` (as ``CheckpointStore.load`` does).
            ref: Which checkpoint to load; None means the store's latest.

        Returns:
            Whatever ``store.load`` returned (for its metadata).

        Raises:
            StateKeyError: The stored payload does not match the registered objects.
        """
        loaded = store.load(ref)
        self.load_committed(loaded.state_dict)
        self.restore()
        return loaded
