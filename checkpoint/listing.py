"""Which directories under a checkpoint root are checkpoints.

A directory ``{step:012d}`` is a checkpoint when its ``manifest.json`` decodes and every file the
manifest lists exists with the recorded size. Anything else is reported with the reason (a torn
write, a manifest naming a missing file, an unreadable manifest) so that readers can warn and skip
it and the store can clean it up; so are the files in a checkpoint's directory that its manifest
does not name. Checksums are not read here (that is the loader's job).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic.checkpoint.backend import Storage
from elastic.checkpoint.errors import CheckpointCorruptError, CheckpointIncompatibleError
from elastic.checkpoint.manifest import MANIFEST_NAME, Manifest, step_dir_name

_STEP_DIR = re.compile(r"^\d{12}$")


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint: its step, its directory URL and its manifest.

    Attributes:
        step: The step it was saved at.
        url: The checkpoint directory, as a full URL.
        manifest: Its decoded manifest.
    """

    step: int
    url: str
    manifest: Manifest = field(repr=False)

    @property
    def epoch(self) -> int | None:
        """The epoch recorded in the manifest."""
        return self.manifest.epoch

    @property
    def generation(self) -> int | None:
        """The writer's generation (fencing token)."""
        return self.manifest.generation

    @property
    def world_size(self) -> int | None:
        """The writer's world size."""
        return self.manifest.world_size

    @property
    def metadata(self) -> Mapping[str, Any]:
        """The writer's metadata."""
        return self.manifest.metadata


@dataclass
class Scan:
    """What a listing found.

    Attributes:
        valid: Complete checkpoints, oldest first: by (generation, step), so that a stale
            writer's checkpoint never counts as newer than one of a newer generation, whatever
            its step (no generation counts as 0).
        invalid: Step to why its directory is not a checkpoint.
        removable: Invalid steps that may be deleted (not a newer format this version cannot read).
        bad_manifests: Removable steps whose manifest is there but unusable (undecodable, or
            naming a missing file): a torn write's, which a new write of the step replaces.
        orphans: Step of a complete checkpoint to the files in its directory that its manifest
            does not name (a payload of a writer that lost the race to publish the step, a torn
            write's leftovers); dot-names (temporary files of writes in progress) aside.
    """

    valid: list[CheckpointRef] = field(default_factory=list)
    invalid: dict[int, str] = field(default_factory=dict)
    removable: set[int] = field(default_factory=set)
    bad_manifests: set[int] = field(default_factory=set)
    orphans: dict[int, list[str]] = field(default_factory=dict)


def scan_checkpoints(storage: Storage) -> Scan:
    """Lists the checkpoint root once and classifies every step directory.

    Args:
        storage: The checkpoint root.

    Returns:
        The complete checkpoints and the unusable directories.
    """
    files: dict[int, dict[str, int]] = {}
    for rel, info in storage.entries().items():
        parts = rel.split("/")
        if not _STEP_DIR.match(parts[0]):
            continue
        step_files = files.setdefault(int(parts[0]), {})
        if len(parts) == 2 and info.get("type") != "directory":
            step_files[parts[1]] = int(info.get("size") or 0)
    scan = Scan()
    for step in sorted(files):
        _classify(storage, scan, step, files[step])
    scan.valid.sort(key=lambda ref: (ref.generation or 0, ref.step))
    return scan


def _classify(storage: Storage, scan: Scan, step: int, present: dict[str, int]) -> None:
    if MANIFEST_NAME not in present:
        scan.invalid[step] = "no manifest (an unfinished or torn write)"
        scan.removable.add(step)
        return
    step_dir = storage.join(step_dir_name(step))
    try:
        manifest = Manifest.from_json(storage.read_bytes(f"{step_dir}/{MANIFEST_NAME}"))
    except FileNotFoundError:
        scan.invalid[step] = "its manifest vanished while listing (being removed)"
        return
    except CheckpointIncompatibleError as exc:  # a newer writer's format: not ours to delete
        scan.invalid[step] = str(exc)
        return
    except CheckpointCorruptError as exc:
        _unusable(scan, step, str(exc))
        return
    problem = _mismatch(manifest, step, present)
    if problem:
        _unusable(scan, step, problem)
        return
    scan.valid.append(CheckpointRef(step, storage.url_of(step_dir), manifest))
    orphans = sorted(n for n in present
                     if n != MANIFEST_NAME and n not in manifest.files and not n.startswith("."))
    if orphans:
        scan.orphans[step] = orphans


def _unusable(scan: Scan, step: int, why: str) -> None:
    """Records that ``step``'s manifest is there but unusable."""
    scan.invalid[step] = why
    scan.removable.add(step)
    scan.bad_manifests.add(step)


def _mismatch(manifest: Manifest, step: int, present: dict[str, int]) -> str | None:
    """Returns why ``present`` does not match ``manifest`` (None if it does)."""
    if manifest.step != step:
        return f"its manifest says step {manifest.step} but lies in the directory of step {step}"
    for name, entry in manifest.files.items():
        if name not in present:
            return f"its manifest lists {name!r}, which is missing (a torn write)"
        if present[name] != entry.size:
            return f"{name!r} has {present[name]} bytes, the manifest says {entry.size}"
    return None
