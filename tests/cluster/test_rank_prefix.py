"""The ``[rankN]:`` prefix torch puts on an uncaught exception's lines: one, the current rank's,
however many times the group was formed in the process."""

from __future__ import annotations

import datetime
import io
import os
import sys

import pytest
import torch.distributed as dist

from elastic.cluster.links.process_group import ProcessGroup
from tests.support.ranks import spawn_ranks


def _rounds(rank: int, store_dir: str, results) -> None:  # noqa: ANN001 (a spawn queue)
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    group = ProcessGroup("gloo", timeout=datetime.timedelta(seconds=30), skip_ports=frozenset(),
                         form_timeout=datetime.timedelta(seconds=30))
    ranks = [rank, 1 - rank, rank, 1 - rank]  # the two swap ranks at every re-formation
    for n, this_round in enumerate(ranks):
        group.form(dist.FileStore(os.path.join(store_dir, f"round-{n}"), 2), this_round, 2)
        if n < len(ranks) - 1:
            group.release("the next round")
            group.destroy()
    try:
        raise RuntimeError("the user's own error")
    except RuntimeError:
        stderr, sys.stderr = sys.stderr, io.StringIO()
        try:
            sys.excepthook(*sys.exc_info())
            written = sys.stderr.getvalue()
        finally:
            sys.stderr = stderr
    group.release("the test ends")
    group.destroy()
    results.put((rank, ranks[-1], written))


@pytest.mark.timeout(120)
def test_an_uncaught_error_after_four_formations_has_one_prefix_of_the_current_rank(tmp_path):
    got = spawn_ranks(_rounds, 2, str(tmp_path))
    for current, written in got.values():
        lines = [line for line in written.splitlines() if line]
        assert lines and lines[-1].endswith("RuntimeError: the user's own error")
        for line in lines:
            assert line.startswith(f"[rank{current}]: ") and "[rank" not in line[len("[rankN]: "):], line
