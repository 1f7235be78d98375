"""``elastic --version``: this package's version and the interpreter's, without importing torch."""

from __future__ import annotations

import platform
from importlib import metadata

DISTRIBUTION = "elastic-trainer"


def describe() -> str:
    """``elastic-trainer 0.1.0 (Python 3.11.9)``; "unknown" when run from a bare source tree."""
    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    return f"{DISTRIBUTION} {version} (Python {platform.python_version()})"
