"""The workers' output as the launcher shows it: whole lines, each with its worker's prefix.

Every worker's stdout and stderr come through a pipe; a reader thread per stream writes each
line, prefixed like torchrun's (``[rank0]:``), to the launcher's own stdout or stderr in one
write under one lock, so lines of two workers never merge mid-line. Optionally each worker's
lines are also appended to a file (``--tee``), and only some local ranks are shown
(``--local-ranks-filter``). One prefix per line: torch's own ``[rankN]:`` on a traceback
gives way to ours. A rank 0's story line (``elastic.console_story``, marked with
``STORY_MARK``) is shown as the launcher's own, without a prefix, whichever worker holds rank 0.
The last lines of stderr are kept, so that the launcher can tell a failure that repeats itself.
Owns nothing else: starting and reaping is ``worker_procs``.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

TAIL_LINES = 20  # stderr lines kept per worker: enough for the last line of a traceback
TEE_CHOICES = {"0": (), "1": ("stdout",), "2": ("stderr",), "3": ("stdout", "stderr")}
STORY_MARK = b"\x1e"  # elastic.console_story.MARK: a line of the job's story from rank 0
# torch's excepthook prefixes a traceback's lines with "[rankN]: ": ours replaces it.
_TORCH_PREFIX = re.compile(rb"^\[rank\d+\]: ?")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--no-prefix``, ``--tee`` and ``--local-ranks-filter`` to ``elastic run``."""
    parser.add_argument("--no-prefix", action="store_true",
                        help="print the workers' lines as they are, without the [localN]: "
                             "prefix (or [rankN]: under --plain)")
    parser.add_argument("--quiet", action="store_true",
                        help="hide the job's story lines (joins, deaths, restarts, "
                             "re-formations, resumes, durable checkpoints); errors are still "
                             "shown")
    parser.add_argument("--tee", choices=sorted(TEE_CHOICES), default="0",
                        help="also write each worker's stdout (1), stderr (2) or both (3) to "
                             "LOG_DIR/output-HOST-localN.log (needs --log-dir)")
    parser.add_argument("--local-ranks-filter", type=_local_ranks, metavar="R[,R...]",
                        help="show only these local ranks' output on the console (files from "
                             "--tee still get every line)")


def _local_ranks(raw: str) -> frozenset[int]:
    try:
        ranks = frozenset(int(part) for part in raw.replace(" ", ",").split(",") if part)
    except ValueError:
        ranks = frozenset({-1})
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"must be local ranks such as 0 or 0,1 (got {raw!r})")
    return ranks


@dataclass(frozen=True)
class OutputOptions:
    """How worker output is shown.

    Attributes:
        prefix: whether lines get a ``[label]:`` prefix.
        tee: which streams are also written to files ("stdout", "stderr").
        tee_dir: the directory of those files (``--log-dir``).
        show: the local ranks shown on the console (None: all).
    """

    prefix: bool = True
    tee: tuple[str, ...] = ()
    tee_dir: str | None = None
    show: frozenset[int] | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.tee and not self.tee_dir:
            raise ValueError("--tee needs --log-dir DIR: the directory its files are written to.")

    @classmethod
    def from_args(cls, args: argparse.Namespace, log_dir: str | None) -> "OutputOptions":
        return cls(prefix=not args.no_prefix, tee=TEE_CHOICES[args.tee], tee_dir=log_dir,
                   show=args.local_ranks_filter, quiet=args.quiet)


@dataclass
class OutputTail:
    """The last stderr lines of one worker, and the threads that are still copying."""

    lines: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    readers: list[threading.Thread] = field(default_factory=list)

    def last_line(self) -> str:
        """The last non-empty stderr line (a traceback's last line names the error)."""
        for line in reversed(self.lines):
            if line.strip():
                return line.strip()
        return ""

    def join(self, timeout_s: float) -> None:
        """Waits, ``timeout_s`` at most in all, until both streams ended (everything the
        worker and its children wrote has been copied)."""
        deadline = time.monotonic() + timeout_s
        for reader in self.readers:
            reader.join(max(0.0, deadline - time.monotonic()))


class WorkerOutput:
    """Copies the workers' pipes to the launcher's stdout/stderr (and files), line by line.

    Args:
        options: prefixes, files and filter.
        host: this node's name, for the file names.
    """

    def __init__(self, options: OutputOptions, host: str) -> None:
        self.options = options
        self.host = host
        self._lock = threading.Lock()

    def attach(self, proc: subprocess.Popen[bytes], local_rank: int, label: str) -> OutputTail:
        """Starts copying ``proc``'s stdout and stderr (both must be pipes)."""
        tail = OutputTail()
        shown = self.options.show is None or local_rank in self.options.show
        prefix = f"[{label}]: ".encode() if self.options.prefix else b""
        for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            assert stream is not None, "start the worker with stdout and stderr pipes"
            target = _console(name) if shown else None
            tee = self._tee_path(local_rank) if name in self.options.tee else None
            reader = threading.Thread(
                target=self._copy, args=(stream, target, prefix, tee,
                                         tail.lines if name == "stderr" else None),
                name=f"elastic-{name}-{proc.pid}", daemon=True)
            reader.start()
            tail.readers.append(reader)
        return tail

    def _tee_path(self, local_rank: int) -> Path:
        assert self.options.tee_dir is not None
        return Path(self.options.tee_dir) / f"output-{self.host}-local{local_rank}.log"

    def _copy(self, stream: IO[bytes], target: IO[bytes] | None, prefix: bytes,
              tee: Path | None, keep: collections.deque[str] | None) -> None:
        # Never stops reading before the stream ends: a worker whose pipe is not drained
        # blocks in its next print once the pipe's buffer is full.
        tee_file = self._open_tee(tee) if tee is not None else None
        try:
            for line in _lines(stream):
                if line.startswith(STORY_MARK):  # rank 0's story: the launcher's own line
                    self._write(sys.stderr.buffer, line[len(STORY_MARK):])
                    continue
                if keep is not None:
                    keep.append(line.decode(errors="replace").rstrip("\n"))
                if tee_file is not None:
                    try:
                        tee_file.write(line)
                        tee_file.flush()
                    except OSError as exc:
                        self._warn(f"stopped writing {tee} ({exc}); the console still gets "
                                   "every line")
                        tee_file.close()
                        tee_file = None
                if target is not None:
                    self._write(target, prefix + (_TORCH_PREFIX.sub(b"", line, count=1)
                                                  if prefix else line))
        finally:
            stream.close()
            if tee_file is not None:
                tee_file.close()

    def _open_tee(self, path: Path) -> IO[bytes] | None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return open(path, "ab")  # noqa: SIM115 (closed by the reader when the stream ends)
        except OSError as exc:
            self._warn(f"cannot write {path} for --tee ({exc}); the console still gets every "
                       "line")
            return None

    def _warn(self, message: str) -> None:
        self._write(sys.stderr.buffer, f"elastic: {message}\n".encode())

    def _write(self, target: IO[bytes], line: bytes) -> None:
        with self._lock:
            try:
                target.write(line)
                target.flush()
            except (OSError, ValueError):
                pass  # our terminal or pipe is gone; the worker goes on, its tee file too


def _lines(stream: IO[bytes]) -> Iterable[bytes]:
    """Whole lines, each ending in a newline (a last line without one gets it added)."""
    for line in iter(stream.readline, b""):
        yield line if line.endswith(b"\n") else line + b"\n"


def _console(name: str) -> IO[bytes]:
    return sys.stdout.buffer if name == "stdout" else sys.stderr.buffer
