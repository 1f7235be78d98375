"""Where a sharded job's re-formation goes, from its workers' events and progress lines.

Owns splitting one survivor's way from a start (the SIGKILL of its peers, or its last step
before a join) to its first step in the new world into phases, from the events every worker
writes (``failure_detected`` / ``membership_changed``, ``round_formed``, ``group_formed``,
``rebuilt`` with the seconds of each part of the sharded rebuild, ``resumed``) and the
benchmark worker's per-step progress lines. Pure functions over those records; imported as
``reshard_timeline`` by ``bench_reshard.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

# the parts of a sharded rebuild, in order, as the ``rebuilt`` event names them
REBUILD = ("choose_s", "mesh_s", "parallelize_s", "check_s", "state_dict_s", "moves_s",
           "load_s", "durable_load_s", "commit_s")


def read_events(folder: Path) -> list[dict]:
    """Every event of every worker under ``folder`` (``events-*.jsonl``), by time."""
    rows: list[dict] = []
    for path in sorted(folder.glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line]
    return sorted(rows, key=lambda r: r["t"])


def split(events: list[dict], progress: list[dict], pid: int, start: float, world: int,
          trigger: str) -> dict[str, float] | None:
    """The phases of worker ``pid`` from ``start`` to its first step at ``world``.

    Args:
        events: all workers' events (``read_events``).
        progress: all workers' progress lines (pid, world, step, t).
        pid: the survivor.
        start: the wall time the way starts at (a kill; a survivor's last step before a join).
        world: the world size it ends in.
        trigger: the event that ends the first phase: ``failure_detected`` after a kill,
            ``membership_changed`` when workers join (the commit that saw them).

    Returns:
        Seconds by phase, in order, with ``ready_s`` (start -> ``resumed``) and ``total_s``
        (start -> first step completed at ``world``); None when this worker did not get there.
    """
    mine = [e for e in events if e["pid"] == pid and e["t"] > start]
    resumed = next((e for e in mine if e["event"] == "resumed" and e.get("world_size") == world),
                   None)
    if resumed is None:
        return None
    before = [e for e in mine if e["t"] <= resumed["t"]]
    detected = next((e for e in before if e["event"] == trigger), None)
    formed = _last(before, "round_formed")
    group = _last(before, "group_formed")
    rebuilt = _last(before, "rebuilt")
    step = next((p for p in progress if p["pid"] == pid and p["world"] == world
                 and p["t"] > resumed["t"]), None)
    if None in (detected, formed, group, rebuilt) or step is None:
        return None
    parts = {name: float(rebuilt.get(name, 0.0)) for name in REBUILD}
    phases = {
        "detection_s": detected["t"] - start,
        "rendezvous_s": formed["t"] - detected["t"],
        "group_s": group["t"] - formed["t"],
        **parts,
        # between the group and the rebuilt event, what the parts do not cover: the small
        # state's sync (a broadcast when some rank lacks the newest commit)
        "small_state_s": rebuilt["t"] - group["t"] - sum(parts.values()),
        "resume_s": resumed["t"] - rebuilt["t"],
        "first_step_s": step["t"] - resumed["t"],
    }
    return {**phases, "ready_s": resumed["t"] - start, "total_s": step["t"] - start}


def last_step_before(progress: list[dict], pid: int, world: int | None, t: float
                     ) -> float | None:
    """The time of ``pid``'s last step at ``world`` (None: at any) before ``t`` (None: none)."""
    times = [p["t"] for p in progress if p["pid"] == pid and p["t"] < t
             and (world is None or p["world"] == world)]
    return times[-1] if times else None


def resumed_at(events: list[dict], pid: int, world: int, after: float) -> float | None:
    """When ``pid`` first resumed training at ``world`` after ``after`` (None: not yet)."""
    return next((e["t"] for e in events if e["pid"] == pid and e["event"] == "resumed"
                 and e.get("world_size") == world and e["t"] > after), None)


def slowest(splits: dict[int, dict[str, float]]) -> tuple[int, dict[str, float]]:
    """The survivor that was ready last (the recovery is over when the last one is)."""
    pid = max(splits, key=lambda p: splits[p]["ready_s"])
    return pid, splits[pid]


def _last(events: list[dict], name: str) -> dict | None:
    found = [e for e in events if e["event"] == name]
    return found[-1] if found else None
