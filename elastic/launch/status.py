"""``elastic status``: a job as etcd sees it, read-only.

Reads the launchers, the live members (host, pid, address), the newest round and its plan
(ranks, world size, commit versions), and the last durable checkpoint when one was recorded
under the job's ``commit`` key. It never writes.
"""

from __future__ import annotations

import json
from typing import Any

from elastic.cluster.etcd_client import EtcdClient
from elastic.cluster.keys import JobKeys
from elastic.cluster import records
from elastic.cluster.plan import Plan
from elastic.cluster.records import RecordError
from elastic.timeouts import Timeouts


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


def render(status: dict[str, Any]) -> str:
    """The human-readable form of ``collect``'s result."""
    lines = [f"job {status['job_id']}" + ("  (finished)" if status["finished"] else "")]
    if status["config"]:
        lines.append("  config: " + ", ".join(f"{k}={v}" for k, v in status["config"].items()
                                              if v is not None))
    lines.append(f"  launchers: {len(status['launchers'])}")
    for m in status["launchers"]:
        lines.append(f"    {m['host']} pid {m['pid']} addr {m['addr']}")
    lines.append(f"  members: {len(status['members'])}")
    for m in status["members"]:
        lines.append(f"    {m['member']:<32} host {m['host']} pid {m['pid']} addr {m['addr']}")
    plan = status["plan"]
    if plan is None:
        lines.append("  round: none formed yet")
    else:
        lines.append(f"  round {status['round']}: world size {plan['world_size']}, "
                     f"master {plan['master']}")
        for rank, member in enumerate(plan["ranks"]):
            version = plan["versions"].get(member, "?")
            lines.append(f"    rank {rank:<3} {member:<32} commit version {version}")
        for member in plan["spares"]:
            lines.append(f"    spare    {member}")
    commit = status["commit"]
    lines.append(f"  last durable checkpoint: {commit if commit else 'none recorded'}")
    return "\n".join(lines)


def show(etcd: str, job_id: str, timeouts: Timeouts, as_json: bool = False) -> int:
    """Prints the status of ``job_id``; returns 0 (1 when the job is unknown).

    etcd requests are retried for ``timeouts.connect``.

    Raises:
        EtcdUnavailableError: etcd could not be reached.
        ValueError: the URL or job id is malformed.
    """
    keys = JobKeys(job_id)
    client = EtcdClient(etcd, timeouts=timeouts, retry_for=timeouts.connect)
    try:
        status = collect(client, keys)
    finally:
        client.close()
    known = status["config"] or status["members"] or status["round"]
    if as_json:
        print(json.dumps(status, indent=2))
    elif not known:
        print(f"elastic status: no job {job_id!r} in etcd at {etcd}; check --job-id "
              "(it is printed by `elastic run`).")
    else:
        print(render(status))
    return 0 if known else 1
