"""How many crashed workers one launcher restarts, and which it does not.

Pure bookkeeping, no I/O: the launcher reports each crash (its slot, the last line it wrote to
stderr, whether it had joined the job and whether it had committed) and prints the reason this
returns for not restarting.
"""

from __future__ import annotations


class Restarts:
    """Which crashed workers the launcher restarts: at most ``max_restarts`` in all, and never
    one that failed before its first commit with the same last line as its previous failure
    (a missing module, a bad argument, a wrong path, a bug in the first step: a restart cannot
    fix those).

    Args:
        max_restarts: ``--max-restarts``.
    """

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.used = 0
        self.failed = 0
        self._last: dict[int, str] = {}

    def refusal(self, local_rank: int, error_line: str, joined: bool,
                finished: bool = False, committed: bool = False) -> str:
        """Counts one crash of the worker in slot ``local_rank``.

        Args:
            local_rank: its slot.
            error_line: the last line it wrote to stderr ("" when unknown).
            joined: whether it ever joined the job.
            committed: whether it ever committed (a worker that committed made progress).
            finished: whether it had returned from the training function (the job is over).

        Returns:
            "" when it is to be restarted (a restart is used), else why it is not.
        """
        if finished:
            self.failed += 1
            return (f"worker local_rank={local_rank} failed after the job had finished (its "
                    "error is above); not restarting it: nothing is left to train.")
        repeated = bool(error_line) and not committed and self._last.get(local_rank) == error_line
        self._last[local_rank] = "" if committed else error_line
        if repeated:
            self.failed += 1
            when = "before its first commit" if joined else "before it joined the job"
            return (f"worker local_rank={local_rank} failed the same way again {when} "
                    f"({error_line}); not restarting it, since a restart cannot fix "
                    "that: fix the script (see its output above) and run it again.")
        if self.used >= self.max_restarts:
            self.failed += 1
            return (f"worker local_rank={local_rank} is not restarted: --max-restarts "
                    f"({self.max_restarts}) is used up.")
        self.used += 1
        return ""
