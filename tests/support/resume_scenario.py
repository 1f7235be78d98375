"""The kill-everything-and-resume scenario, shared by the local and the S3 tests."""

from __future__ import annotations

import signal
import time
from collections import Counter

import torch

from elastic.checkpoint import CheckpointStore

SAMPLES = 240
EPOCHS = 4
ARGS = ["--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch", "8",
        "--commit-every", "4", "--step-ms", "40"]


def run_until_checkpoint(make_job, env: dict[str, str], store: CheckpointStore, epoch: int):
    """Starts 3 workers and SIGKILLs all of them once the durable commit of ``epoch`` exists."""
    job = make_job(ARGS, env)
    job.start_together(range(3))
    job.wait_until(lambda: any(ref.epoch == epoch for ref in store.list()), 120,
                   f"the durable commit of epoch {epoch}")
    for i in range(3):
        job.signal(i, signal.SIGKILL)
    for i in range(3):
        assert job.wait_exit(i) == -signal.SIGKILL
    return job


def resume(make_job, env: dict[str, str], expected_epoch: int, expected_params: list[float]):
    """Starts 2 workers on the same URL and checks where they resumed and how they ended."""
    job = make_job(ARGS, env)
    job.start_together(range(2))
    for i in range(2):
        assert job.wait_exit(i) == 0, job.tails()
    first_reset = next(p for p in job.progress(0) if p.get("event") == "reset")
    assert first_reset["params"] == expected_params, "did not resume with the saved parameters"
    first_step = next(p for p in job.progress(0) if "loss" in p)
    assert first_step["epoch"] == expected_epoch and first_step["world"] == 2
    results = [job.result(i) for i in range(2)]
    assert results[0]["params"] == results[1]["params"]
    ledger = results[0]["ledger"]
    for e in range(EPOCHS):
        counts = Counter(ledger[e])
        assert all(c == 1 for c in counts.values()), f"epoch {e}: an index repeats"
        assert set(counts) | set(results[0]["skipped"][e]) == set(range(SAMPLES)), f"epoch {e}"
    assert results[0]["result"]["loss"] < 0.15  # untrained: ~1.3; 4 short epochs reach ~0.08
    return job


def model_params(store: CheckpointStore, ref=None) -> list[float]:
    payload = store.load(ref).state_dict
    model = payload["objects"]["model"]
    return torch.cat([model["weight"].flatten(), model["bias"].flatten()]).tolist()


def start_and_expect_refusal(job, url: str, workers: int = 2) -> str:
    """Starts ``workers`` workers that cannot read ``url`` at their resume, checks that each
    stopped (exit 1, nothing trained) with one last line naming ``url``; returns their logs."""
    started = time.monotonic()
    job.start_together(range(workers))
    codes = [job.wait_exit(i, timeout=120) for i in range(workers)]
    took_s = time.monotonic() - started
    assert codes == [1] * workers, job.tails()
    assert not [p for i in range(workers) for p in job.progress(i) if "loss" in p], \
        "a worker trained from scratch while its checkpoint URL could not be read"
    logs = [(job.out / f"worker-{i}.log").read_text(errors="replace") for i in range(workers)]
    for log in logs:
        assert "CheckpointResumeError" in log.strip().splitlines()[-1], job.tails()
        assert url in log.strip().splitlines()[-1], job.tails()
    assert took_s < 90, f"stopping took {took_s:.0f} s (under load)"
    return "".join(logs)
