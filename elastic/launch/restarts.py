"""How many crashed workers one launcher restarts, and which it does not.

Pure bookkeeping, no I/O: the launcher reports each crash (its slot, the last line it wrote to
stderr, whether it had joined the job and whether it had committed) and prints the reason this
returns for not restarting.
"""

from __future__ import annotations

import re

_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")
# Python errors that end a script before it can join the job: its file or an import is broken.
_IMPORT_FAILURES = frozenset({"SyntaxError", "IndentationError", "TabError", "ImportError",
                              "ModuleNotFoundError"})


def import_failure(error_line: str) -> str | None:
    """The type of the Python error named by a traceback's last line (``SyntaxError: ...``)
    when it is one that a broken script file or import raises; None otherwise."""
    while error_line.startswith("[") and "]: " in error_line:  # torch's "[rank0]: " prefix
        error_line = error_line.split("]: ", 1)[1]
    name = error_line.split(":", 1)[0].strip()
    return name if name in _IMPORT_FAILURES else None


class Restarts:
    """Which crashed workers the launcher restarts: at most ``max_restarts`` in all, and never
    one that failed before its first commit with the same last line as its previous failure, but
    for the numbers in it (a missing module, a bad argument, a wrong path, a bug in the first
    step: a restart cannot fix those).

    Args:
        max_restarts: ``--max-restarts``.
    """

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.used = 0
        self.failed = 0
        self._last: dict[int, str] = {}

    def never_joined(self, local_rank: int, pid: int) -> str:
        """Counts a worker that exited 0 without calling ``ElasticState.run``; says so."""
        self.failed += 1
        return (f"worker local_rank={local_rank} pid={pid} exited 0 but never joined the job "
                "(ElasticState.run was not called): call state.run(train) in the script, or run "
                "a plain torch.distributed script with `elastic run --plain`.")

    def refusal(self, local_rank: int, error_line: str, joined: bool,
                finished: bool = False, committed: bool = False,
                setup_error: bool = False) -> str:
        """Counts one crash of the worker in slot ``local_rank``.

        Args:
            local_rank: its slot.
            error_line: the last line it wrote to stderr ("" when unknown).
            joined: whether it ever joined the job.
            committed: whether it ever committed (a worker that committed made progress).
            finished: whether it had returned from the training function (the job is over).
            setup_error: whether it stopped on a mistake in its setup (it said which).

        Returns:
            "" when it is to be restarted (a restart is used), else why it is not.
        """
        if finished:
            self.failed += 1
            return (f"worker local_rank={local_rank} failed after the job had finished (its "
                    "error is above); not restarting it: nothing is left to train.")
        if setup_error:
            self.failed += 1
            return (f"worker local_rank={local_rank} stopped on a mistake in its setup (its "
                    "line is above); not restarting it.")
        if not joined and import_failure(error_line) is not None:
            self.failed += 1
            return (f"worker local_rank={local_rank} failed before it joined the job "
                    f"({error_line}): the script or one of its imports is broken; not restarting "
                    "it: fix the script (see its output above) and run it again.")
        shape = _NUMBERS.sub("#", error_line)  # a step, a shape or an address may differ
        repeated = bool(error_line) and not committed and self._last.get(local_rank) == shape
        self._last[local_rank] = "" if committed else shape
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
