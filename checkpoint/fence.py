"""Who may publish a checkpoint: the generation fence, and the error of a lost publish race.

A writer may publish only while no complete checkpoint of a newer generation exists under the
URL (``check_fence``, checked before the payload and again before the manifest); where the
backend has a conditional create, two writers of one step cannot both publish, and the loser
gets ``race_lost``'s error. This module reads scans and builds errors; it does no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from elastic.checkpoint.errors import CheckpointError, CheckpointFencedError, CheckpointRaceError
from elastic.checkpoint.listing import CheckpointRef, Scan


def check_fence(scan: Scan, generation: int | None, step: int, url: str) -> None:
    """Raises when ``scan`` holds a checkpoint of a newer generation than ``generation``.

    Raises:
        CheckpointFencedError: a newer generation has published under ``url`` (``newer`` is
            its newest checkpoint).
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


def race_lost(step: int, generation: int | None, step_url: str,
              winner: CheckpointRef | None) -> CheckpointRaceError:
    """The error of a writer whose conditional create of ``step``'s manifest found one there.

    Args:
        step: the step both wrote.
        generation: the loser's generation.
        step_url: the step's directory.
        winner: the checkpoint that won, when it could be listed.
    """
    by = (f" by generation {winner.generation} of job {winner.metadata.get('job_id')!r}"
          if winner is not None else "")
    return CheckpointRaceError(
        f"step {step} from generation {generation} was not published: another writer "
        f"published step {step} first{by} at {step_url}, which was left as it is. Two writers "
        "share this checkpoint URL: stop one, or give each its own URL.", newer=winner)
