"""Uninterrupted reference runs, each computed once per test session and shared.

Equivalence tests compare an elastic job with an uninterrupted run of the same script and
arguments; several tests (and every case of a matrix) compare with the same run. ``References``
(the session fixture ``references``) starts such a run beside the first test that asks for it
and keeps its worker-0 result; later tests get the result without running it again. A run is
deterministic in its script, arguments and world size, which make its key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.support.harness import Job

Key = tuple[str, tuple[str, ...], int]


class Reference:
    """One uninterrupted run: already done (its result kept) or running beside a test."""

    def __init__(self, results: dict[Key, dict[str, Any]], key: Key, job: Job | None) -> None:
        self._results = results
        self._key = key
        self.job = job

    def result(self) -> dict[str, Any]:
        """Worker 0's result, once every worker of the run exited with 0 (kept for the session)."""
        if self._key not in self._results:
            assert self.job is not None
            for index in range(self._key[2]):
                assert self.job.wait_exit(index) == 0, self.job.tails()
            self._results[self._key] = self.job.result(0)
        return self._results[self._key]


class References:
    """The session's uninterrupted runs, by script, arguments and world size."""

    def __init__(self) -> None:
        self._results: dict[Key, dict[str, Any]] = {}

    def start(self, make_job: Callable[..., Job], script: Path | str, args: Sequence[str],
              world: int = 1) -> Reference:
        """The run of ``script`` with ``args`` in world ``world``: started now with
        ``make_job`` (beside the caller's elastic job) unless an earlier test finished it."""
        key = (str(Path(script).resolve()), tuple(args), world)
        if key in self._results:
            return Reference(self._results, key, None)
        job = make_job(list(args), script=Path(script))
        if world == 1:
            job.start(0)
        else:
            job.start_together(range(world))
        return Reference(self._results, key, job)
