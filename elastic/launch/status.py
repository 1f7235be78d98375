"""``elastic status``: a job as etcd sees it, read-only.

Reads the launchers, the live members (host, pid, address), the newest round and its plan
(ranks, world size, commit versions), and the last durable checkpoint when one was recorded
under the job's ``commit`` key. It never writes.
"""

from __future__ import annotations

import json
import time
from typing import Any

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds import records
from elastic.cluster.rounds.plan import Plan
from elastic.cluster.rounds.records import RecordError
from elastic.foundation.errors import EtcdUnavailableError
from elastic.foundation.settings import EtcdSecurity
from elastic.foundation.timeouts import Timeouts


def _members(client: EtcdClient, keys: JobKeys) -> list[dict[str, Any]]:
    kvs, _ = client.get_prefix(keys.members)
    found = []
    for kv in kvs:
        try:
            info = json.loads(kv.value)
        except ValueError:
            info = {}
        if not isinstance(info, dict):  # written by something else: show the key alone
            info = {}
        found.append({"member": kv.key[len(keys.members):], "host": info.get("host"),
                      "pid": info.get("pid"), "addr": info.get("addr")})
    return found


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def collect(client: EtcdClient, keys: JobKeys) -> dict[str, Any]:
    """Reads everything ``elastic status`` shows.

    Raises:
        EtcdUnavailableError: etcd could not be reached.
        EtcdRecordError: the round counter or the current plan is malformed.
    """
    round_kv = client.get(keys.round)
    n = records.round_number(keys.round, round_kv.value) if round_kv else 0
    plan_kv = client.get(keys.plan(n)) if n else None
    try:
        plan = Plan.from_json(plan_kv.value, n) if plan_kv else None
    except RecordError as exc:
        raise records.corrupt(plan_kv.key, str(exc)) from None
    config_kv, commit_kv = client.get(keys.config), client.get(keys.commit)
    dones, _ = client.get_prefix(keys.dones(n)) if n else ([], 0)
    return {
        "job_id": keys.job_id,
        "config": _json_or_text(config_kv.value) if config_kv else None,
        "launchers": _members(client, keys.launchers()),
        "members": _members(client, keys),
        "round": n,
        "finished": bool(dones),
        "plan": None if plan is None else {
            "world_size": plan.world_size, "ranks": plan.ranks, "spares": plan.spares,
            "master": f"{plan.master_addr}:{plan.master_port}", "versions": plan.versions},
        "commit": _json_or_text(commit_kv.value) if commit_kv else None,
    }


def render(status: dict[str, Any], now: float | None = None) -> str:
    """The human-readable form of ``collect``'s result: a header, one table row per member
    (by rank, then spares, then members not in the round), the launchers and the checkpoint.

    Args:
        status: what ``collect`` returned.
        now: the wall-clock time the checkpoint's age is measured from (default: now).
    """
    plan = status["plan"]
    head = f"job {status['job_id']}"
    head += (f": round {status['round']}, world size {plan['world_size']}, master "
             f"{plan['master']}" if plan else ": no round formed yet")
    lines = [head + ("  (finished)" if status["finished"] else "")]
    if status["config"]:
        lines.append("config: " + ", ".join(f"{k}={v}" for k, v in status["config"].items()
                                            if v is not None))
    lines += _table(["RANK", "MEMBER", "HOST", "PID", "ADDRESS", "VERSION AT JOIN"],
                    _member_rows(status))
    lines.append("launchers: " + ("; ".join(f"{m['host']} pid {m['pid']} ({m['addr']})"
                                            for m in status["launchers"]) or "none"))
    lines.append(f"last durable checkpoint: {_checkpoint(status['commit'], now)}")
    return "\n".join(lines)


def _member_rows(status: dict[str, Any]) -> list[list[str]]:
    plan = status["plan"] or {"ranks": [], "spares": [], "versions": {}}
    live = {m["member"]: m for m in status["members"]}
    placed = [(str(rank), member) for rank, member in enumerate(plan["ranks"])]
    placed += [("spare", member) for member in plan["spares"]]
    in_round = {member for _, member in placed}
    placed += [("-", member) for member in live if member not in in_round]
    rows = []
    for rank, member in placed:
        info = live.get(member, {})
        rows.append([rank, member, str(info.get("host") or "(gone)"), str(info.get("pid") or ""),
                     str(info.get("addr") or ""), str(plan["versions"].get(member, ""))])
    return rows


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["members: none"]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in [headers, *rows]]


def _checkpoint(commit: Any, now: float | None) -> str:
    if not commit:
        return "none recorded"
    if not isinstance(commit, dict):
        return str(commit)
    text = f"version {commit.get('version')}"
    if commit.get("epoch") is not None:
        text += f" (epoch {commit['epoch']})"
    text += f" at {commit.get('url')}"
    if isinstance(commit.get("t"), (int, float)):
        age_s = max(0.0, (time.time() if now is None else now) - commit["t"])
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(commit["t"]))
        text += f", written {when} ({age_s:.0f} s ago)"
    return text


def show(etcd: str, job_id: str, timeouts: Timeouts, as_json: bool = False,
         security: EtcdSecurity | None = None) -> int:
    """Prints the status of ``job_id``; returns 0 (1 when the job is unknown).

    etcd requests are retried for ``timeouts.connect``; ``security`` holds the TLS files and
    etcd user.

    Raises:
        EtcdUnavailableError: etcd could not be reached.
        EtcdAccessError: etcd refused the certificates, the user, or its permissions.
        ValueError: the URL or job id is malformed.
    """
    keys = JobKeys(job_id)
    try:
        client = EtcdClient(etcd, timeouts=timeouts, retry_for=timeouts.connect,
                            security=security)
        try:
            status = collect(client, keys)
        finally:
            client.close()
    except EtcdUnavailableError as exc:
        raise EtcdUnavailableError(
            f"{exc} A job started without --etcd had an embedded etcd that ended with it: "
            "an ended job has no status to show (its --log-dir has its events for `elastic "
            "report`).") from None
    known = status["config"] or status["members"] or status["round"]
    if as_json:
        print(json.dumps(status, indent=2))
    elif not known:
        print(f"elastic status: no job {job_id!r} in etcd at {etcd}; check --job-id "
              "(it is printed by `elastic run`).")
    else:
        print(render(status))
    return 0 if known else 1
