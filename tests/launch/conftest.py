"""The `cli` fixture: starts `elastic` processes and always kills them and their workers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import Cli, kill_everything


@pytest.fixture
def cli(tmp_path: Path) -> Iterator:
    started: list[Cli] = []

    def start(*args: str, name: str = "cli", env: dict[str, str] | None = None) -> Cli:
        proc = Cli(list(args), tmp_path, f"{name}{len(started)}", env)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        kill_everything(started, [tmp_path / "events"])
