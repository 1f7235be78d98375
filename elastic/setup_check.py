"""The checks a worker makes before it joins the job: mistakes that no restart fixes.

Owns the worker's side of the checkpoint URL, whichever source gave it (the script's
``ElasticState(checkpoint=...)``, ``--checkpoint`` or ``ELASTIC_CHECKPOINT``): two sources that
name different locations, and a location that cannot be written, are found before the first
step instead of after the whole run. A ``SetupError`` ends the process in one line with exit
status 1 (``ELASTIC_DEBUG=1``: the error with its traceback) and marks the worker's lease file,
so that ``elastic run`` does not restart it. It must not contact etcd.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from elastic.cluster.worker_lease_file import RAN, SETUP_ERROR, append_mark
from elastic.foundation.daemon_call import DaemonCall
from elastic.foundation.errors import CheckpointUnusableError, SetupError
from elastic.foundation.settings import WorkerSettings

SCRIPT = "ElasticState(checkpoint={!r})"
FLAG = "--checkpoint / ELASTIC_CHECKPOINT {}"


def checkpoint_url(in_script: str | None, settings: WorkerSettings) -> tuple[str | None, str]:
    """The checkpoint URL the worker uses and how to name its source in a message.

    Raises:
        SetupError: the script and ``--checkpoint`` / ``ELASTIC_CHECKPOINT`` name different
            locations.
    """
    from_env = settings.checkpoint_from_env
    if in_script and from_env and in_script != from_env:
        raise SetupError(
            f"the script's {SCRIPT.format(in_script)} and {FLAG.format(from_env)} name two "
            "checkpoint locations; keep one of them (or give both the same URL).")
    if in_script:
        return in_script, SCRIPT.format(in_script)
    return from_env, FLAG.format(from_env)


def check_checkpoint(in_script: str | None, settings: WorkerSettings) -> None:
    """Writes and removes a probe under the worker's checkpoint URL, unless ``elastic run``
    probed that same URL at launch already.

    Raises:
        SetupError: two sources name different locations.
        CheckpointUnusableError: no backend for the scheme, no credentials, or not writable.
    """
    url, source = checkpoint_url(in_script, settings)
    launched = settings.lease_file is not None  # `elastic run` probed its --checkpoint
    if url is None or (launched and url == settings.checkpoint_from_env):
        return
    from elastic.checkpoint import CheckpointError, check_writable  # noqa: PLC0415 (torch)
    retry = settings.timeouts.storage_retry
    probe = DaemonCall(lambda: check_writable(url, retry_for=retry), "checkpoint-probe")
    try:
        probe.result((retry * 2).total_seconds())
    except CheckpointError as exc:
        raise CheckpointUnusableError(f"{source}: {exc}") from exc
    except TimeoutError:
        raise CheckpointUnusableError(
            f"{source}: the storage did not answer a probe write within {retry * 2}. Check "
            "that it is reachable from this machine, or raise ELASTIC_STORAGE_RETRY if it is "
            "this slow.") from None


@contextlib.contextmanager
def one_line_on_setup_error(settings: WorkerSettings) -> Iterator[None]:
    """Turns a ``SetupError`` into one line and exit status 1 (``SystemExit``), and marks the
    lease file so that the launcher does not restart the worker. With ``ELASTIC_DEBUG=1`` the
    error itself propagates, with its cause."""
    try:
        yield
    except SetupError as exc:
        if settings.lease_file is not None:
            append_mark(settings.lease_file, SETUP_ERROR)
        if settings.debug:
            raise
        print(f"elastic: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def before_joining(in_script: str | None, settings: WorkerSettings) -> None:
    """Tells the launcher that ``ElasticState.run`` was called, then checks that the launcher
    that started this worker still runs (the parent check behind ``PR_SET_PDEATHSIG``) and the
    checkpoint URL; a mistake ends the process in one line (``one_line_on_setup_error``)."""
    if settings.lease_file is not None:
        append_mark(settings.lease_file, RAN)
    with one_line_on_setup_error(settings):
        if settings.launcher_pid is not None and os.getppid() != settings.launcher_pid:
            raise SetupError(f"the launcher (pid {settings.launcher_pid}) that started this "
                             "worker is gone; not joining the job without it.")
        check_checkpoint(in_script, settings)
