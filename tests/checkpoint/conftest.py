"""Fixtures of the checkpoint tests: a clean ``memory://`` store and a marker file.

The object-store servers (S3, GCS) and the fault-injecting filesystem are shared with other folders: see
``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fsspec.implementations.memory import MemoryFileSystem


@pytest.fixture
def clean_memory_fs() -> Iterator[None]:
    """Clears fsspec's global ``memory://`` store before and after the test."""
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    yield
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


@pytest.fixture
def marker_path(tmp_path: Path) -> Path:
    """A file that a malicious payload would create; tests assert it never appears."""
    path = tmp_path / "pwned"
    assert not path.exists()
    return path
