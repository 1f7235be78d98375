"""Draws what ``bench_membership.py`` measured: time and etcd work per member against N, log-log.

Usage: ``.venv/bin/python benchmarks/plot_membership.py RESULT.json [RESULT.json ...]
[--out docs/membership-scale.png]``. Each JSON is one labelled setting (before, after, ...),
with one or more sweeps (a size measured more than once is drawn at its median); a phase that
did not finish within the run's limit is left out of the time panels (and said so in the
legend). matplotlib comes with the ``test`` and ``report`` extras.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [("first_round", "seconds", "first round: s to every member holding the plan"),
          ("one_death", "seconds", "one death: s to every survivor holding the next plan"),
          ("first_round", "etcd_requests", "first round: etcd requests per member (etcd /metrics)"),
          ("one_death", "etcd_requests", "one death: etcd requests per member (etcd /metrics)"),
          ("first_round", "etcd_watch_events",
           "first round: watch events per member (etcd /metrics)"),
          ("one_death", "etcd_watch_events", "one death: watch events per member (etcd /metrics)")]


def value(result: dict, phase: str, field: str) -> float | None:
    for p in result["phases"]:
        if p["phase"] == phase:
            if field == "seconds":
                return p["seconds"]
            return p["per_member"].get(field)
    return None


def by_size(points: list[tuple[int, float | None]]) -> list[tuple[int, float | None]]:
    """One point per N, in order: the median of its sweeps' values (None if none finished)."""
    sizes: dict[int, list[float]] = {}
    for n, v in points:
        sizes.setdefault(n, [])
        if v:
            sizes[n].append(v)
    return [(n, statistics.median(vs) if vs else None) for n, vs in sorted(sizes.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default="docs/membership-scale.png")
    args = parser.parse_args()
    runs = [json.loads(Path(path).read_text()) for path in args.results]
    fig, axes = plt.subplots(3, 2, figsize=(11, 11.5))
    for ax, (phase, field, title) in zip(axes.flat, PANELS):
        for i, run in enumerate(runs):  # one colour per run in every panel
            points = by_size([(r["n"], value(r, phase, field)) for r in run["results"]])
            shown = [(n, v) for n, v in points if v]
            missing = [n for n, v in points if not v]
            label = f"{run['label']} (lease TTL {run.get('lease_ttl_s', 3.0):g} s)"
            if missing:
                label += f"; N={','.join(map(str, missing))} did not finish"
            if shown:
                ax.plot(*zip(*shown), marker="o", label=label, color=f"C{i}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("members N")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    cores = {run["cores"] for run in runs}
    fig.suptitle(f"Membership on one local etcd ({'/'.join(map(str, cores))} cores, "
                 f"members simulated as threads of 4 processes)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
