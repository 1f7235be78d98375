"""Children a worker starts without Python's ``os.fork``, each living on after the worker.

``start_children`` starts one child each way that runs ``exec`` in the child without the fork
hooks (``os.system``, ``subprocess.Popen(close_fds=False)``, ``os.posix_spawn``), all sleeping
for a minute, and appends their pids to ``pids_path`` so that the test can end them by PID.
"""

import os
import shutil
import subprocess
from pathlib import Path

LIFETIME = "60"


def start_children(pids_path: Path) -> None:
    sleep = shutil.which("sleep") or "/bin/sleep"
    os.system(f"{sleep} {LIFETIME} & echo $! >> {pids_path}")  # noqa: S605 (the test's own)
    popen = subprocess.Popen([sleep, LIFETIME], close_fds=False, stdin=subprocess.DEVNULL)
    spawned = os.posix_spawn(sleep, [sleep, LIFETIME], dict(os.environ))
    with open(pids_path, "a") as pids:
        pids.write(f"{popen.pid}\n{spawned}\n")
