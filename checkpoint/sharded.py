"""Sharded checkpoints: every rank's shards in ``torch.distributed.checkpoint`` (DCP) format,
our manifest last.

Owns the collective protocol of one sharded save and one sharded load over a process group.
Saving: rank 0 claims the step (fencing, a torn leftover removed), every rank writes its own
shards in parallel with DCP's ``FsspecWriter`` and default planner, the ranks read the files
back and hash them between them, rank 0 publishes the manifest. Loading: the ranks verify the
checksums between them, then DCP's load fills the caller's (sharded) state dict, its planner
resharding from whatever world size wrote it. A directory without a manifest (a rank died
first) is never listed, and ``torch.distributed.checkpoint.load`` reads any published one.
Never builds models or process groups, and never imports the rest of the project.
"""

from __future__ import annotations

import io
import logging
import pickle
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from elastic.checkpoint.dcp_reader import SafeMetadataReader
from elastic.checkpoint.errors import (CheckpointCorruptError, CheckpointError,
                                       CheckpointIncompatibleError, CheckpointReadError,
                                       CheckpointWriteError)
from elastic.checkpoint.listing import CheckpointRef
from elastic.checkpoint.manifest import DCP_FORMAT, FileEntry, checked_metadata, step_dir_name
from elastic.checkpoint.payload import (PAYLOAD_NAME, file_entry, read_payload, to_host,
                                        verify_payload, write_payload)
from elastic.checkpoint.reading import LoadedCheckpoint, newest_readable
from elastic.checkpoint.store import CheckpointStore

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: DCP's global metadata file, written by its coordinator once every rank's shards are written.
DCP_METADATA = ".metadata"
#: What the coordinator hands on to the other ranks (a storage error comes as either).
_FORWARDED = (CheckpointError, ValueError, OSError)


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are read weights-only.

    The default planner unpickles them with ``weights_only=False``, which runs code from the
    file; every other value (tensors) DCP's reader already loads weights-only.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """See base class."""
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            _set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _set_path(root: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        root = root[key]
    root[path[-1]] = value


class ShardedCheckpoints:
    """Sharded saves and loads into one ``CheckpointStore``; every call is collective.

    Args:
        store: the store whose root, layout, fencing and retention the checkpoints share. Every
            rank holds one for the same URL; rank 0's lists, publishes and retains.
        group: the process group of the ranks that hold the shards (the default group if None).
    """

    def __init__(self, store: CheckpointStore, group: dist.ProcessGroup | None = None) -> None:
        self._store = store
        self._group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)

    def save(self, step: int, state_dict: Mapping[str, Any],
             metadata: Mapping[str, Any] | None = None,
             before_publish: Callable[[], None] | None = None,
             payload: Any = None) -> CheckpointRef:
        """Writes every rank's shards of ``state_dict``, then the manifest; on every rank.

        Args:
            step: the optimizer step; names the directory.
            state_dict: this rank's state dict (DTensors, as
                ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives them).
            metadata: as for ``CheckpointStore.save`` (JSON values; ``generation`` fences).
            before_publish: called on rank 0 right before the manifest is written.
            payload: rank 0's state besides the shards (step, sampler, plain values; tensors
                and plain values only), written by rank 0 as one ``torch.save`` file next to
                the shards and handed back by :meth:`load`; ignored on other ranks.

        Returns:
            The published checkpoint.

        Raises:
            ValueError: bad step or metadata.
            CheckpointFencedError: a newer generation has published.
            CheckpointWriteError: a rank's write failed; nothing was published.
            CheckpointError: ``step`` already has a checkpoint, or the storage failed.
        """
        meta = checked_metadata(step, {"world_size": self._world, **(metadata or {})})
        url = self._on_coordinator(lambda: self._store.open_step(step, meta))
        writer = FsspecWriter(url, sync_files=True, **self._store.storage_options)
        try:
            with warnings.catch_warnings():
                # the step has no manifest (open_step refuses a published one): files there are
                # a try that never published, and DCP overwriting them is this store's design
                warnings.filterwarnings("ignore", "Detected an existing checkpoint", UserWarning)
                dcp.save(state_dict, storage_writer=writer, process_group=self._group)
        except CheckpointException as exc:  # DCP raises it on every rank alike
            self._on_coordinator(lambda: self._store.discard_step(step))
            raise CheckpointWriteError(
                f"writing the shards of step {step} to {url} failed: {exc}. Earlier checkpoints "
                "are intact; training can go on and save again.") from exc
        mine = self._hash_share(step, url, payload if self._rank == 0 else None)
        hashed = self._all_gathered(mine)

        def publish() -> CheckpointRef:
            problems = [h for h in hashed if isinstance(h, str)]
            if problems:
                self._store.discard_step(step)
                raise CheckpointWriteError(
                    f"the shards of step {step} could not be read back: {'; '.join(problems)}. "
                    "Earlier checkpoints are intact.")
            files = {n: e for share in hashed for n, e in share.items()}
            return self._store.publish_files(step, files, meta, DCP_FORMAT, before_publish)

        return self._on_coordinator(publish)

    def load(self, state_dict: Mapping[str, Any], ref: CheckpointRef | None = None
             ) -> LoadedCheckpoint:
        """Fills ``state_dict`` in place from a sharded checkpoint, at this group's world size.

        Args:
            state_dict: this rank's state dict of the new formation (DTensors); load it into
                the model and optimizer afterwards (``set_state_dict``).
            ref: the checkpoint; None takes the newest sharded one that verifies, skipping
                (with a warning) newer ones that are torn or corrupt (one that the storage
                fails to read stops the load: it may be intact).

        Returns:
            The checkpoint loaded: its ref, metadata, and as ``state_dict`` the ``payload``
            given to :meth:`save` (None if there was none).

        Raises:
            CheckpointNotFoundError: ``ref`` is None and no sharded checkpoint verifies.
            CheckpointCorruptError: ``ref`` was given and does not verify.
            CheckpointIncompatibleError: the state dict has keys or shapes the checkpoint lacks.
            CheckpointReadError: the storage failed while reading.
        """
        if ref is not None:
            return self._read(ref, state_dict)
        candidates, skipped = self._on_coordinator(self._candidates)
        return newest_readable(candidates, lambda c: self._read(c, state_dict), skipped,
                               self._store.url)

    def _candidates(self) -> tuple[list[CheckpointRef], list[str]]:
        scan = self._store.scan()
        return ([r for r in scan.valid if r.manifest.payload_format == DCP_FORMAT],
                self._store.skipped_newer(scan))

    def _read(self, ref: CheckpointRef, state_dict: Mapping[str, Any]) -> LoadedCheckpoint:
        """Verifies ``ref`` (each rank a share of its files), checks keys, then DCP-loads."""
        if ref.manifest.payload_format != DCP_FORMAT:
            raise CheckpointIncompatibleError(
                f"checkpoint {ref.url} is not sharded (format {ref.manifest.payload_format!r}); "
                "load it with CheckpointStore.load.")
        reader = SafeMetadataReader(ref.url, **self._store.storage_options)
        index: list[Metadata] = []  # DCP's, as this rank read it
        problems = [p for p in self._all_gathered(self._verify_share(ref, reader, index))
                    if p is not None]
        unread = [why for kind, why in problems if kind == "unread"]
        if unread:
            raise CheckpointReadError(f"reading checkpoint {ref.url} failed: {'; '.join(unread)}."
                                      " Check that the storage is reachable.")
        if problems:
            raise CheckpointCorruptError("; ".join(why for _, why in problems))
        _check_fits(ref, index[0], state_dict)
        try:
            dcp.load(state_dict, storage_reader=reader, planner=_WeightsOnlyLoadPlanner(),
                     process_group=self._group)
        except CheckpointException as exc:
            raise CheckpointReadError(f"loading the shards of {ref.url} failed: {exc}") from exc
        return LoadedCheckpoint(ref, self._payload_of(ref), ref.manifest.metadata)

    def _payload_of(self, ref: CheckpointRef) -> Any:
        """The payload saved with ``ref`` (checksum verified again; weights-only), or None."""
        entry = ref.manifest.files.get(PAYLOAD_NAME)
        if entry is None:
            return None
        storage = self._store.storage
        try:
            return read_payload(storage, storage.join(step_dir_name(ref.step), PAYLOAD_NAME),
                                entry)
        except OSError as exc:
            raise CheckpointReadError(f"reading {PAYLOAD_NAME} of {ref.url} failed: {exc!r}. "
                                      "Check that the storage is reachable.") from exc

    def _hash_share(self, step: int, url: str, payload: Any) -> dict[str, FileEntry] | str:
        """This rank's share of reading the files back (and rank 0's payload, written): name
        to entry, or what went wrong. The files are the ones DCP's index (``.metadata``) names,
        read back from storage: what ``dcp.save`` returns differs between torch releases (2.11
        hands back metadata without the files)."""
        storage = self._store.storage
        step_dir = storage.join(step_dir_name(step))
        try:
            index = SafeMetadataReader(url, **self._store.storage_options).read_metadata()
            names = sorted({info.relative_path for info in index.storage_data.values()}
                           | {DCP_METADATA})
            share = {n: file_entry(storage, f"{step_dir}/{n}")
                     for n in names[self._rank::self._world]}
            if payload is not None:
                share[PAYLOAD_NAME] = write_payload(storage, f"{step_dir}/{PAYLOAD_NAME}",
                                                    to_host(payload))
            return share
        except (OSError, EOFError, TypeError, ValueError, AttributeError, ImportError, KeyError,
                pickle.UnpicklingError, CheckpointError) as exc:  # an unreadable index, too
            return f"rank {self._rank}: {exc!r}"  # every rank still reaches the all-gather

    def _verify_share(self, ref: CheckpointRef, reader: SafeMetadataReader,
                      index: list[Metadata]) -> tuple[str, str] | None:
        """This rank's share of the files checked against the manifest, then DCP's index read
        into ``index``: what went wrong, or None (every rank still reaches the all-gather)."""
        storage = self._store.storage
        step_dir = storage.join(step_dir_name(ref.step))
        names = sorted(ref.manifest.files)
        try:
            for name in names[self._rank::self._world]:
                verify_payload(storage, f"{step_dir}/{name}", ref.manifest.files[name])
            index.append(reader.read_metadata())
        except CheckpointCorruptError as exc:
            return "corrupt", f"checkpoint {ref.url}: {exc}"
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError,
                ImportError) as exc:
            return "corrupt", f"checkpoint {ref.url}: its DCP index does not decode: {exc}"
        except (OSError, CheckpointError) as exc:
            return "unread", f"rank {self._rank}: {exc!r}"
        return None

    def _all_gathered(self, mine: T) -> list[T]:
        out: list[Any] = [None] * self._world
        dist.all_gather_object(out, mine, group=self._group)
        return out

    def _on_coordinator(self, call: Callable[[], T]) -> T:
        """Runs ``call`` on rank 0 and gives every rank its result, or raises its error on
        every rank, so that all of them go on (or stop) together."""
        box: list[Any] = [None]
        if self._rank == 0:
            try:
                box[0] = (True, call())
            except _FORWARDED as exc:
                box[0] = (False, exc)
        dist.broadcast_object_list(box, group=self._group, group_src=0)
        ok, value = box[0]
        if not ok:
            raise value
        return value


def _check_fits(ref: CheckpointRef, metadata: Metadata, state_dict: Mapping[str, Any]) -> None:
    """Raises ``CheckpointIncompatibleError`` naming the keys of ``state_dict`` that the
    checkpoint lacks or holds with another global shape (DCP would fail on them later)."""
    flat, _ = flatten_state_dict(dict(state_dict))
    stored = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in stored)
    shapes = sorted(
        f"{k} {tuple(v.shape)} (checkpoint: {tuple(stored[k].size)})" for k, v in flat.items()
        if isinstance(v, torch.Tensor) and isinstance(stored.get(k), TensorStorageMetadata)
        and tuple(v.shape) != tuple(stored[k].size))
    if missing or shapes:
        raise CheckpointIncompatibleError(
            f"checkpoint {ref.url} does not fit this state: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, other shapes {shapes[:5]}. Load it into the "
            "model and optimizer that wrote it (the same parameter names and sizes).")
