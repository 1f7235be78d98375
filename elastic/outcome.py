"""Whether a run did anything: the checks ``ElasticState.run`` makes when the function returns.

A run that resumed a finished job from its checkpoint returns at once and trains nothing; a run
whose every durable commit failed saved nothing. Both used to end with exit status 0 and no
word. This module notices them and raises a typed error naming the fix; it owns nothing else.
"""

from __future__ import annotations

from elastic.durable import DurableCommits
from elastic.foundation.errors import DurableCommitsFailedError, NothingTrainedError

FIRST_ROUND = 1  # the number of a job's first round (``Rendezvous`` counts from the last + 1)


class RunOutcome:
    """Records the first call of the training function and judges the run when it returns.

    Args:
        resume_finished: the user allows resuming a finished job (``--resume-finished``).
    """

    def __init__(self, resume_finished: bool = False) -> None:
        self.resume_finished = resume_finished
        self.initial_version = 0  # the worker's own first commit, before it joins
        self.first_version: int | None = None
        self.first_round: int | None = None

    def called(self, version: int, round_: int) -> None:
        """Notes a call of the training function (only the first one counts)."""
        if self.first_version is None:
            self.first_version, self.first_round = version, round_

    def check(self, version: int, durable: DurableCommits | None) -> None:
        """Judges a run whose training function returned with commit ``version``.

        Raises:
            NothingTrainedError: the job's first round started from a checkpoint (a version
                above this worker's initial commit) and no commit followed.
            DurableCommitsFailedError: this worker wrote durable commits and none succeeded.
        """
        if durable is not None and durable.written == 0 and durable.last_error is not None:
            raise DurableCommitsFailedError(
                f"none of the durable commits to {durable.url} was written, so nothing of this "
                f"run is saved (last error: {durable.last_error}). Fix the checkpoint location "
                "and run again.")
        resumed = (self.first_round == FIRST_ROUND
                   and (self.first_version or 0) > self.initial_version)
        if resumed and version == self.first_version and not self.resume_finished:
            where = f" from {durable.url}" if durable is not None else ""
            raise NothingTrainedError(
                f"the job resumed its checkpoint{where} (commit {version}) and the training "
                "function returned without a commit: it had already finished, so nothing was "
                "trained. Use a new checkpoint location to train again, or pass "
                "--resume-finished (ELASTIC_RESUME_FINISHED=1) if that is what you meant.")
