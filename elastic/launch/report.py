"""``elastic report LOGDIR``: a job's event files as tables and a PNG timeline.

Reads every ``*.jsonl`` file in the directory: the workers' events, among them rank 0's
``progress`` events (written at commits, at most twice a second, with the value of a registered
plain ``step``), which give the steps/s. World size comes from the
``resumed`` events of each round, recoveries are measured from the first ``failure_detected``
to the last ``resumed`` of the round that followed it. Plotting uses matplotlib's Agg backend;
nothing here talks to etcd.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.foundation.errors import ElasticError


class ReportError(ElasticError):
    """The log directory holds no events to report on, or the timeline cannot be written."""


@dataclass
class Round:
    """One formed round as seen in the events."""

    round: int
    t: float
    world_size: int
    reason: str
    version: int
    recovery_s: float | None = None


@dataclass
class Timeline:
    """What the events of one job say, with times relative to the first event."""

    t0: float
    end: float
    rounds: list[Round] = field(default_factory=list)
    failures: list[float] = field(default_factory=list)
    failure_workers: list[str] = field(default_factory=list)  # who detected each failure
    joins: list[float] = field(default_factory=list)
    leaves: list[float] = field(default_factory=list)
    steps: list[tuple[float, int]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    reshards: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # by round
    changes_at_commit: int = 0


def load_events(log_dir: str | Path) -> list[dict[str, Any]]:
    """Every event in ``log_dir``'s JSON-lines files, sorted by time.

    Raises:
        ReportError: there is no such directory or no event in it.
    """
    path = Path(log_dir)
    if not path.is_dir():
        raise ReportError(f"{log_dir} is not a directory; pass the --log-dir of the run.")
    events = []
    for file in sorted(path.glob("*.jsonl")):
        for line in file.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line torn by a kill
            if isinstance(record, dict) and "t" in record and "event" in record:
                events.append(record)
    if not events:
        raise ReportError(f"no events in {log_dir}: run with `elastic run --log-dir {log_dir}`.")
    return sorted(events, key=lambda e: e["t"])


def build_timeline(events: list[dict[str, Any]]) -> Timeline:
    """Turns sorted events into rounds, recoveries, failures, joins and progress."""
    t0 = events[0]["t"]
    timeline = Timeline(t0=t0, end=events[-1]["t"] - t0)
    by_round: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        t, kind = e["t"] - t0, e["event"]
        if kind == "resumed":
            by_round.setdefault(int(e.get("round", 0)), []).append(e)
        elif kind == "failure_detected":
            timeline.failures.append(t)
            timeline.failure_workers.append(str(e.get("worker", "")))
        elif kind == "joined":
            timeline.joins.append(t)
        elif kind == "leaving":
            timeline.leaves.append(t)
        elif kind == "progress" and "step" in e:
            timeline.steps.append((t, int(e["step"])))
        elif kind == "resharded":
            timeline.reshards.setdefault(int(e.get("round", 0)), []).append({**e, "t": t})
        elif kind in ("checkpoint_written", "checkpoint_failed", "checkpoint_loaded"):
            timeline.checkpoints.append({**e, "t": t})
        elif kind == "membership_changed" and e.get("rank") == 0:
            timeline.changes_at_commit += 1
    for i, n in enumerate(sorted(by_round)):
        first = by_round[n][0]
        timeline.rounds.append(Round(n, first["t"] - t0, int(first.get("world_size", 0)),
                                     _round_reason(by_round[n], is_first=i == 0),
                                     max(int(e.get("version", 0)) for e in by_round[n])))
    previous_start = -1.0
    for r, n in zip(timeline.rounds, sorted(by_round)):
        if r.reason.startswith("failure"):
            detected = [f for f in timeline.failures if previous_start < f <= r.t]
            last = max(e["t"] for e in by_round[n]) - t0
            r.recovery_s = last - min(detected) if detected else None
        previous_start = r.t
    return timeline


def _round_reason(resumed: list[dict[str, Any]], is_first: bool) -> str:
    """Why a round formed, from all its members' ``resumed`` events (not the earliest one's:
    a restarted worker says "start" in the round its survivors call "failure").

    "failure" or "change" when any member says so; later, "join" (only new workers: a restart
    or a new launcher); else "start".
    """
    reasons = {str(e.get("reason", "")) for e in resumed}
    newcomers = sum(1 for e in resumed if e.get("reason") == "start")
    for reason in ("failure", "change"):
        if reason in reasons:
            return reason + (f" +{newcomers} new" if newcomers and not is_first else "")
    return "start" if is_first else f"join +{newcomers} new"


def steps_per_second(steps: list[tuple[float, int]], window_s: float = 2.0) -> list[tuple[float, float]]:
    """A moving rate of the progress records: (t, steps/s) over ``window_s`` windows."""
    rates, start = [], 0
    for i, (t, step) in enumerate(steps):
        while steps[start][0] < t - window_s:
            start += 1
        t_a, s_a = steps[start]
        if t - t_a > 0.2:
            rates.append((t, max(0.0, (step - s_a) / (t - t_a))))
    return rates


def render_tables(timeline: Timeline) -> str:
    """The rounds, recoveries, joins and leaves as plain-text tables."""
    width = max([len("reason")] + [len(r.reason) for r in timeline.rounds])
    lines = [f"{'round':>5}  {'t (s)':>7}  {'world':>5}  {'reason':<{width}}  {'version':>7}  "
             f"recovery (s)"]
    for r in timeline.rounds:
        recovery = f"{r.recovery_s:.2f}" if r.recovery_s is not None else ""
        lines.append(f"{r.round:>5}  {r.t:>7.2f}  {r.world_size:>5}  {r.reason:<{width}}  "
                     f"{r.version:>7}  {recovery}")
    recoveries = [r for r in timeline.rounds if r.recovery_s is not None]
    lines.append("")
    lines.append(f"recoveries: {len(recoveries)}" + "".join(
        f"\n  at {r.t:.2f} s: {r.recovery_s:.2f} s (failure detected -> resumed in world "
        f"{r.world_size})" for r in recoveries))
    lines.append(f"workers joined: {len(timeline.joins)}   left gracefully: "
                 f"{len(timeline.leaves)}   failures: {len(_incidents(timeline.failures))}")
    lines += [f"  failure at {t:.2f} s: detected by {peers} peer{'s' * (peers != 1)}"
              for t, peers in _detections(timeline)]
    lines.append(f"world changes agreed at a commit: {timeline.changes_at_commit}")
    if timeline.steps:
        lines.append(f"progress: {timeline.steps[-1][1]} steps in {timeline.end:.1f} s")
    lines += _reshard_lines(timeline.reshards)
    lines += _checkpoint_lines(timeline.checkpoints)
    return "\n".join(lines)


def _reshard_lines(reshards: dict[int, list[dict[str, Any]]]) -> list[str]:
    """One line per round that resharded sharded state: the world change, the bytes moved next
    to the least this layout needs and to the dead ranks' shards, the slowest rank's time."""
    lines = [f"resharded in round {n} at {es[0]['t']:.2f} s: world {es[0].get('from_world')} -> "
             f"{es[0].get('to_world')}, version {es[0].get('version')}: moved "
             f"{es[0].get('bytes_moved')} bytes (minimum {es[0].get('bytes_minimum')}, dead "
             f"ranks' shards {es[0].get('bytes_lost')}), "
             f"{max(float(e.get('reshard_s', 0.0)) for e in es):.2f} s"
             for n, es in sorted(reshards.items())]
    return [""] + lines if lines else []


def _checkpoint_lines(checkpoints: list[dict[str, Any]]) -> list[str]:
    """The durable checkpoints: written (with blocked and write times), failed, loaded."""
    if not checkpoints:
        return []
    lines = ["", f"{'t (s)':>7}  {'checkpoint':<10}  {'version':>7}  {'blocked (s)':>11}  "
                 f"{'write (s)':>9}  url / error"]
    for c in checkpoints:
        kind = c["event"].removeprefix("checkpoint_")
        blocked = f"{c['blocked_s']:.3f}" if "blocked_s" in c else ""
        write = f"{c['write_s']:.3f}" if "write_s" in c else ""
        detail = c.get("url") or c.get("error", "")
        lines.append(f"{c['t']:>7.2f}  {kind:<10}  {c.get('version', ''):>7}  {blocked:>11}  "
                     f"{write:>9}  {detail}")
    return lines


def plot(timeline: Timeline, out: str | Path) -> None:
    """Writes the timeline PNG: world size (and steps/s when known), failures and joins."""
    import matplotlib  # noqa: PLC0415 (optional dependency, heavy import)
    import matplotlib.ticker  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rates = steps_per_second(timeline.steps)
    rows = 2 if rates else 1
    fig, axes = plt.subplots(rows, 1, figsize=(9, 2.8 * rows + 0.6), sharex=True, squeeze=False)
    ax = axes[0][0]
    xs = [r.t for r in timeline.rounds] + [timeline.end]
    ys = [r.world_size for r in timeline.rounds]
    if ys:
        ax.step(xs, ys + ys[-1:], where="post", color="tab:blue", linewidth=2)
        ax.set_ylim(0, max(ys) + 1)
    ax.set_ylabel("world size")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # whole workers
    ax.set_title("elastic job timeline")
    for r in timeline.rounds:
        if r.recovery_s is not None:
            ax.annotate(f"recovered in {r.recovery_s:.1f} s", (r.t, r.world_size),
                        textcoords="offset points", xytext=(4, 6), fontsize=8)
    for row in axes:
        for i, t in enumerate(_incidents(timeline.failures)):
            row[0].axvline(t, color="tab:red", linestyle="--", alpha=0.7,
                           label="failure" if i == 0 else None)
        for i, t in enumerate(timeline.joins):
            row[0].axvline(t, color="tab:green", linestyle=":", alpha=0.6,
                           label="worker joined" if i == 0 else None)
    ax.legend(loc="lower right", fontsize=8)
    if rates:
        axes[1][0].plot([t for t, _ in rates], [v for _, v in rates], color="tab:orange")
        axes[1][0].set_ylabel("optimizer steps/s")
        axes[1][0].set_ylim(bottom=0)
    axes[-1][0].set_xlabel("seconds since the first event")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _detections(timeline: Timeline, gap_s: float = 1.0) -> list[tuple[float, int]]:
    """Each failure incident's time and how many distinct workers detected it."""
    found: list[tuple[float, set[str]]] = []
    for t, worker in zip(timeline.failures, timeline.failure_workers):
        if not found or t - found[-1][0] > gap_s:
            found.append((t, set()))
        found[-1][1].add(worker)
    return [(t, len(workers)) for t, workers in found]


def _incidents(times: list[float], gap_s: float = 1.0) -> list[float]:
    """Failure detections of several workers within ``gap_s`` count as one incident."""
    incidents: list[float] = []
    for t in times:
        if not incidents or t - incidents[-1] > gap_s:
            incidents.append(t)
    return incidents


def report(log_dir: str, out: str | None = None) -> int:
    """Prints the tables and writes the PNG (or says why not); returns 0.

    Raises:
        ReportError: no events in ``log_dir``, or the PNG cannot be written.
    """
    timeline = build_timeline(load_events(log_dir))
    print(render_tables(timeline))
    target = Path(out) if out else Path(log_dir) / "report.png"
    try:
        plot(timeline, target)
    except ImportError:  # the tables above are the report; the picture is optional
        print("elastic report: no PNG: matplotlib is missing "
              "(`pip install 'elastic-trainer[report]'`).", file=sys.stderr)
        return 0
    except OSError as exc:
        raise ReportError(f"the timeline {target} cannot be written ({exc.strerror or exc}); "
                          "give --out a path in a directory this user can write.") from None
    print(f"timeline written to {target}")
    return 0
