"""Fault markers written whole: a test polls for the file and reads it at once, so it must never
see it created but not yet written (the marker is written beside it, then renamed)."""

import json
import os
from pathlib import Path
from typing import Any


def write_marker(path: Path, record: dict[str, Any]) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)
