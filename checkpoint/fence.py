"""The fencing rule of a checkpoint root: a writer older than the newest published generation
may not publish.

Owns the check only; the generation itself comes from the writer (the job's fencing epoch and
round, see ``elastic/cluster/fencing.py``). It does no I/O beyond what the caller's scan did.
"""

from __future__ import annotations

from collections.abc import Callable

from elastic.checkpoint.errors import CheckpointError, CheckpointFencedError
from elastic.checkpoint.listing import Scan


def check_fence(scan: Scan, generation: int | None, step: int, url: str) -> None:
    """Refuses ``step`` of ``generation`` when ``scan`` holds a newer generation's checkpoint.

    Args:
        scan: a listing of the root.
        generation: the writer's fencing generation; None writes unfenced.
        step: the step being written (for the message).
        url: the root URL (for the message).

    Raises:
        CheckpointFencedError: a newer generation has already published.
    """
    if generation is None:
        return
    fenced = [r for r in scan.valid if r.generation is not None and r.generation > generation]
    if fenced:
        newer = max(fenced, key=lambda r: (r.generation, r.step))
        writer = newer.metadata.get("job_id")
        raise CheckpointFencedError(
            f"step {step} from generation {generation} was not published: generation "
            f"{newer.generation}{f' of job {writer!r}' if writer else ''} has already "
            f"written to {url}. This writer is stale; rejoin the job to get the "
            "current generation.", newer=newer)


def check_fence_after(scan: Callable[[], Scan], exc: BaseException, generation: int | None,
                      step: int, url: str) -> None:
    """After a failed write: ``CheckpointFencedError`` if a newer generation published
    meanwhile (whose cleanup of unfinished writes may be why this one failed). When the storage
    cannot even be listed, the write's own error stands.

    Args:
        scan: lists the root.
        exc: the write's error (chained as the cause).
        generation: the writer's generation; None writes unfenced.
        step: the step that failed.
        url: the root URL (for the message).
    """
    if generation is None:
        return
    try:
        found = scan()
    except CheckpointError:
        return
    try:
        check_fence(found, generation, step, url)
    except CheckpointFencedError as fenced:
        raise fenced from exc
