"""The rollback matrix's torch.compile case (issue 39), too slow to compile for the test suite.

Usage: ``.venv/bin/python benchmarks/rollback_compiled.py`` (not part of the test suite). Runs
``tests/scenarios/test_rollback_matrix.py`` for the ``compiled`` loop (a ``torch.compile``d
model under DDP, CPU inductor) in both commit modes: two SIGKILLs and joiners each, the end
state compared bit for bit with an uninterrupted run. Prints pytest's verdict and the wall time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    started = time.monotonic()
    code = subprocess.call(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/scenarios/test_rollback_matrix.py", "-k", "compiled"],
        cwd=REPO, env=dict(os.environ, ELASTIC_TEST_COMPILED="1"))
    print(f"compiled rollback matrix: exit {code} in {time.monotonic() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
