"""Forks probe workers from a warm-start template and prints their reports (for the tests).

Usage: ``python -m tests.workers.fork_host N SCRIPT [ARGS...]``: starts the template for
``python SCRIPT ARGS``, forks N workers from it one after the other (each with PROBE_MARKER=i
and FSSPEC_PROBE naming i too), waits for each and prints ``{"exit": code, "out": its stdout}``
per worker, then a line with the template's pid. Runs in its own process: the warm start makes its caller a child subreaper.
"""

import json
import os
import sys
from datetime import timedelta

from elastic.launch.warm_start import WarmStart


def main() -> int:
    count, command = int(sys.argv[1]), [sys.executable, *sys.argv[2:]]
    warm = WarmStart(command, dict(os.environ), (), timedelta(seconds=120), timedelta(seconds=10))
    warm.start()
    if not warm.wait_ready():
        return 3
    print(json.dumps({"template": warm.process.pid}), flush=True)
    try:
        for n in range(count):
            proc = warm.spawn({**os.environ, "PROBE_MARKER": str(n),
                               "FSSPEC_PROBE": json.dumps({"marker": n}),
                                "PROBE_TEMPLATE": str(warm.process.pid)}, piped=True)
            assert proc is not None and proc.stdout is not None
            out = proc.stdout.read().decode()
            print(json.dumps({"exit": proc.wait(60), "out": out, "pid": proc.pid}), flush=True)
    finally:
        warm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
