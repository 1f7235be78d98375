"""A hostile member for the tests: it claims the newest commit, becomes rank 0, and sends code.

Whoever can write the job's etcd prefix can register and ask to join with any commit version.
This script does exactly that through the cluster layer (the join request claims version
``HUGE``, so the plan makes it rank 0, the source of the state), answers the versions
all-gather with the same claim, and then sends to the first receiver (rank 1, which forwards it
along the chain of receivers, ``state.feed``), where the state's skeleton is expected, a pickle
whose unpickling writes ``{out}/code-ran-{pid}`` in the receiving process. It leaves right after
(its lease is revoked), so the honest members can go on without it. It writes
``hostile-sent`` once the payload is on its way.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.cluster.cluster import Cluster
from elastic.foundation.events import EventLog
from elastic.foundation.settings import WorkerSettings
from elastic.state.feed import LENGTH_TAG, SKELETON_TAG

HUGE = 2**62  # still an int64, so that the versions all-gather carries it


class RunsCode:
    """Unpickling this calls ``exec``: it writes a marker file in the receiving process."""

    def __init__(self, marker_dir: str) -> None:
        self.marker_dir = marker_dir

    def __reduce__(self):
        source = (f"import os; open(os.path.join({self.marker_dir!r}, "
                  f"'code-ran-%d' % os.getpid()), 'w').write('unpickled')")
        return exec, (source,)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_known_args()[0].out)
    settings = WorkerSettings.resolve(etcd=None, job_id=None, min_workers=None,
                                      max_workers=None, checkpoint=None)
    cluster = Cluster(settings, EventLog(None, "hostile"))
    try:
        topology = cluster.form("start", HUGE)
        assert topology.rank == 0, f"the plan did not make the hostile member rank 0: {topology}"
        mine = torch.tensor([HUGE, 0, 0], dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in range(topology.world_size)]
        dist.all_gather(gathered, mine)  # the receivers' newest_source
        blob = pickle.dumps(RunsCode(str(out)))  # where the skeleton goes
        dist.send(torch.tensor([len(blob)], dtype=torch.int64), 1, tag=LENGTH_TAG)
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), 1, tag=SKELETON_TAG)
        (out / "hostile-sent").write_text(json.dumps({"round": topology.round,
                                                      "world": topology.world_size,
                                                      "pid": os.getpid()}))
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
