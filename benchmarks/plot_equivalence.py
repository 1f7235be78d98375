"""Plots the loss curves of an uninterrupted world-2 job and an elastic 3->2->3->2 job.

Runs the real jobs of tests/support/equivalence_scenario.py (constant global batch 12, float64,
dropout seeded per sample, DataLoader(num_workers=2) with random augmentation) on an embedded
etcd on 127.0.0.1, prints the largest differences and writes the plot to ``--out`` (default
``runs/loss_curves.png``, which git ignores; ``--out docs/loss_curves.png`` replaces the
documentation's figure).

    .venv/bin/python benchmarks/plot_equivalence.py [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402
from tests.support.equivalence_scenario import (ARGS, ELASTIC_FAULTS, HOLD, SCRIPT,  # noqa: E402
                                        finish_reference, max_difference, run_elastic,
                                        start_reference)
from tests.support.harness import Job  # noqa: E402

EXTRA = ["--dropout", "0.2", "--loader-workers", "2"]


def run_jobs(etcd_url: str, work: Path) -> tuple[dict, dict, list[dict]]:
    """Runs both jobs; returns the reference result, one survivor's result, its progress."""
    reference = Job(etcd_url, work / "reference", f"plot-ref-{os.getpid()}", ARGS + EXTRA,
                    script=SCRIPT)
    elastic = Job(etcd_url, work / "elastic", f"plot-elastic-{os.getpid()}",
                  ARGS + EXTRA + HOLD, {"FAULTS": ELASTIC_FAULTS}, script=SCRIPT)
    try:
        start_reference(reference)
        survivor = run_elastic(elastic)[0]
        return finish_reference(reference), survivor, elastic.progress(0)
    finally:
        reference.kill_all()
        elastic.kill_all()


def plot(reference: dict, elastic: dict, progress: list[dict], out: Path) -> None:
    """Draws both committed loss curves and the elastic job's world size per step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(reference["history"]) + 1)
    world = {p["step"]: p["world"] for p in progress if "loss" in p}  # last (committed) try
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    top.plot(steps, reference["history"], color="#1f77b4", linewidth=4, alpha=0.45,
             label="uninterrupted, 2 workers")
    top.plot(steps, elastic["history"], color="#d62728", linewidth=1.2, marker=".",
             label="elastic: 3 -> 2 (SIGKILL) -> 3 (join) -> 2 (SIGTERM)")
    diff = max_difference(reference["history"], elastic["history"])
    top.set_ylabel("loss over the global batch")
    top.set_title(f"Same seed, global batch 12: max |loss difference| = {diff:.1e}")
    top.legend()
    bottom.step(steps, [world[s] for s in steps], where="mid", color="#555555")
    bottom.set_ylabel("workers")
    bottom.set_yticks([2, 3])
    bottom.set_xlabel("global step (float64, dropout, DataLoader(num_workers=2))")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "loss_curves.png",
                        help="where to write the PNG (default: runs/loss_curves.png)")
    out = parser.parse_args().out
    server = EmbeddedEtcd().start()
    try:
        with tempfile.TemporaryDirectory() as work:
            reference, elastic, progress = run_jobs(server.url, Path(work))
    finally:
        server.stop()
    print(f"max |param difference| = {max_difference(reference['params'], elastic['params']):.3e}")
    loss_diff = max_difference(reference["history"], elastic["history"])
    print(f"max |loss difference|  = {loss_diff:.3e}")
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(reference, elastic, progress, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
