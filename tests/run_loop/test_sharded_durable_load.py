"""What a sharded job says when the checkpoint URL holds no durable sharded checkpoint: nothing
alarming at a first start, a warning only when some shard of the last commit was lost with it.

A world of one gloo rank (``ShardedCheckpoints`` collects over the default group); the URL is a
fresh directory, as when a job starts for the first time with ``ELASTIC_CHECKPOINT`` set.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from elastic.durable import DurableCommits
from elastic.sharded_durable import ShardedDurable
from tests.support.gloo_group import run_in_group


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))


def _load_from_an_empty_url(rank: int, world: int, url: str) -> list[dict]:
    handler = _Kept()
    logger = logging.getLogger("elastic.sharded_durable")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    durable = DurableCommits(url)
    durable.sharded = True
    model = torch.nn.Linear(3, 2)
    objects = {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}
    loader = ShardedDurable(durable, lambda: None, dict)
    results = []
    for load in (lambda: loader.load(objects), lambda: loader.load(objects, lost=True)):
        handler.records.clear()
        results.append({"small": load(), "logged": list(handler.records)})
    return results


def test_an_empty_checkpoint_url_is_a_warning_only_when_a_shard_was_lost(tmp_path: Path):
    url = str(tmp_path / "ckpt")
    first_start, lost = run_in_group(_load_from_an_empty_url, 1, tmp_path, url)[0]
    assert first_start["small"] is None
    assert [m for level, m in first_start["logged"] if level >= logging.WARNING] == []
    warned = [m for level, m in lost["logged"] if level >= logging.WARNING]
    assert lost["small"] is None and len(warned) == 1 and url in warned[0]
