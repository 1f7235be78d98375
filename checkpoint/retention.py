"""Retention: which checkpoints under a store's URL go once a newer one is published.

Keeps the ``keep`` newest checkpoints whose payload reads back intact (each step is read back
once), removes the older complete ones (the manifest first: a directory stops being a checkpoint
before its payload goes), the torn directories older than the newest complete one, and the files
in a kept checkpoint's directory that its manifest does not name (a payload of a writer that lost
the race to publish that step). It never writes a checkpoint and knows nothing of fencing.
"""

from __future__ import annotations

import logging

from elastic.checkpoint.backend import Storage
from elastic.checkpoint.errors import CheckpointCorruptError
from elastic.checkpoint.listing import CheckpointRef, Scan
from elastic.checkpoint.manifest import MANIFEST_NAME, step_dir_name
from elastic.checkpoint.payload import verify_payload

logger = logging.getLogger(__name__)


class Retention:
    """The retention of one store.

    Args:
        storage: the store's storage.
        keep: how many verified checkpoints to keep (None: all).
        url: the store's URL (for messages).
    """

    def __init__(self, storage: Storage, keep: int | None, url: str) -> None:
        self._storage = storage
        self._keep = keep
        self._url = url
        self._verified: set[int] = set()  # steps whose payload was read back intact

    def apply(self, scan: Scan, writing_step: int | None) -> None:
        """Removes, from what ``scan`` found, complete checkpoints beyond the newest ``keep``
        ones that verify, and torn directories older than the newest complete one (except
        ``writing_step``, this store's write in progress), and the orphans of those it keeps."""
        if not scan.valid:
            return
        newest = max(ref.step for ref in scan.valid)
        stale = self._beyond_kept(scan.valid)
        torn = [s for s in sorted(scan.removable) if s < newest and s != writing_step]
        for ref in stale:
            self._remove(ref.step, manifest_first=True)
        gone = {ref.step for ref in stale}
        for step, names in sorted(scan.orphans.items()):
            if step not in gone:
                self._remove_orphans(step, names)
        for step in torn:
            logger.warning("removing unfinished checkpoint directory %s (%s)",
                           self._dir_url(step), scan.invalid[step])
            self._remove(step, manifest_first=False)

    def _beyond_kept(self, valid: list[CheckpointRef]) -> list[CheckpointRef]:
        """The checkpoints older than the ``keep`` newest that verify; none when fewer verify."""
        self._verified &= {ref.step for ref in valid}  # forget what is gone
        if self._keep is None or len(valid) <= self._keep:
            return []
        kept: list[CheckpointRef] = []
        for ref in reversed(valid):
            if self._verifies(ref):
                kept.append(ref)
                if len(kept) == self._keep:
                    return valid[:valid.index(ref)]  # older by (generation, step)
        logger.warning("retention keeps every checkpoint under %s: fewer than keep=%d of them "
                       "verify", self._url, self._keep)
        return []

    def _verifies(self, ref: CheckpointRef) -> bool:
        """Whether ``ref``'s files match its manifest (each step is read back once)."""
        if ref.step in self._verified:
            return True
        step_dir = self._storage.join(step_dir_name(ref.step))
        try:
            if not ref.manifest.files:
                raise CheckpointCorruptError(f"checkpoint {ref.url} lists no files")
            for name, entry in ref.manifest.files.items():  # one, or every rank's shards
                verify_payload(self._storage, f"{step_dir}/{name}", entry)
        except CheckpointCorruptError as exc:
            logger.warning("checkpoint %s does not verify and is not counted as kept: %s",
                           ref.url, exc)
            return False
        except OSError as exc:
            logger.warning("could not read back checkpoint %s (%r); not counted as kept",
                           ref.url, exc)
            return False
        self._verified.add(ref.step)
        return True

    def _remove(self, step: int, manifest_first: bool) -> None:
        step_dir = self._storage.join(step_dir_name(step))
        try:
            if manifest_first:  # it stops being a checkpoint before its payload goes
                self._storage.remove(f"{step_dir}/{MANIFEST_NAME}")
            self._storage.remove(step_dir, recursive=True)
        except OSError as exc:
            logger.warning("retention could not remove %s: %r", self._dir_url(step), exc)

    def _remove_orphans(self, step: int, names: list[str]) -> None:
        logger.warning("removing %s from checkpoint %s: its manifest does not name them (the "
                       "payload of a writer that lost the race to publish this step, or a torn "
                       "write's leftovers)", names, self._dir_url(step))
        step_dir = self._storage.join(step_dir_name(step))
        for name in names:
            try:
                self._storage.remove(f"{step_dir}/{name}")
            except OSError as exc:
                logger.warning("retention could not remove %s/%s: %r", step_dir, name, exc)

    def _dir_url(self, step: int) -> str:
        return self._storage.url_of(self._storage.join(step_dir_name(step)))

