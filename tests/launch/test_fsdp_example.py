"""The FSDP2 language-model example runs under `elastic run`, tiny, for a few steps: its loss
is printed and goes down, and its epoch-end durable commit is a sharded checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elastic.checkpoint import CheckpointStore

pytestmark = pytest.mark.timeout(180)
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "fsdp_lm.py")


def test_the_fsdp_language_model_example_trains_tiny_and_writes_a_sharded_checkpoint(
        cli, tmp_path):
    url = str(tmp_path / "ckpt")
    run = cli("run", "-n", "2", "--checkpoint", url, "--log-dir", str(tmp_path / "events"),
              EXAMPLE, "--size", "tiny", "--epochs", "1", "--text-bytes", "4000",
              "--global-batch", "8")
    assert run.wait(150) == 0, run.text()
    losses = [float(v) for v in re.findall(r"loss ([\d.]+)", run.text())]
    assert len(losses) >= 3, run.text()
    assert losses[-1] < losses[0] - 0.3, losses  # bytes: ~5.5 nats untrained
    ref = CheckpointStore(url).latest()
    assert ref is not None and ref.manifest.payload_format == "torch.distributed.checkpoint"
    assert ref.world_size == 2 and ref.epoch == 1
