"""What TLS and etcd authentication cost on the formation path: plain etcd against TLS + auth.

Usage: ``.venv/bin/python benchmarks/bench_tls_formation.py [--reps 5] [--workers 2]``.

Two etcd servers on 127.0.0.1 run side by side: the embedded one (plaintext, no users) and one
with TLS, client certificates required and authentication on (a per-job user whose role covers
the job's prefixes only; test certificates made with ``cryptography``). Runs alternate between
them, the same invocation each time (``tests/workers/elastic_worker.py --steps 5``, started
together), and the figures come from the workers' own events:

- connect: a fresh ``EtcdClient``'s first read (channel, TLS handshake, Authenticate), in this
  process, median of ``--reps * 10``;
- join to formed: from a worker's ``joined`` event to its first ``group_formed`` (rendezvous on
  etcd, then the gloo group formed on the round's etcd-backed store: every etcd call of it);
- rendezvous and form: the first round's ``rendezvous_s`` and ``form_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from elastic.cluster.etcd.client import EtcdClient  # noqa: E402
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402
from elastic.foundation.settings import EtcdSecurity  # noqa: E402
from tests.support.tls_etcd import SecureEtcd, make_pki  # noqa: E402

WORKER = REPO / "tests" / "workers" / "elastic_worker.py"
JOB_TIMEOUT_S = 120


def run_job(url: str, job_id: str, workers: int, extra_env: dict[str, str]) -> list[dict]:
    """Runs one job to its end; returns every worker's events."""
    out = Path(tempfile.mkdtemp(prefix="bench-tls-"))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               ELASTIC_ADVERTISE_ADDR="127.0.0.1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               ELASTIC_ETCD=url, ELASTIC_JOB_ID=job_id, ELASTIC_MIN_WORKERS=str(workers),
               ELASTIC_LOG_DIR=str(out), **extra_env)
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--steps", "5"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True) for _ in range(workers)]
    try:
        for proc in procs:
            if proc.wait(timeout=JOB_TIMEOUT_S) != 0:
                raise RuntimeError(f"a worker of {job_id} failed; see {out}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    events = []
    for path in out.glob("*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line]
    return events


def formation(events: list[dict]) -> dict[str, float]:
    """Per job: the slowest worker's join-to-formed, and the first round's phases (max)."""
    by_pid: dict[int, dict[str, float]] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        mine = by_pid.setdefault(e["pid"], {})
        if e["event"] == "joined":
            mine.setdefault("joined", e["t"])
        elif e["event"] == "round_formed":
            mine.setdefault("rendezvous", e["rendezvous_s"])
        elif e["event"] == "group_formed":
            mine.setdefault("formed", e["t"])
            mine.setdefault("form", e["form_s"])
    return {"join_to_formed_s": max(m["formed"] - m["joined"] for m in by_pid.values()),
            "rendezvous_s": max(m["rendezvous"] for m in by_pid.values()),
            "form_s": max(m["form"] for m in by_pid.values())}


def connect_s(url: str, security: EtcdSecurity, key: str) -> float:
    started = time.perf_counter()
    client = EtcdClient(url, security=security)
    try:
        client.get(key)
    finally:
        client.close()
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    pki = make_pki(Path(tempfile.mkdtemp(prefix="bench-pki-")))
    plain, secure = EmbeddedEtcd().start(), SecureEtcd(pki).start()
    try:
        secure.enable_auth()
        password = "bench-secret"
        results: dict[str, list[dict[str, float]]] = {"plain": [], "tls+auth": []}
        connects: dict[str, list[float]] = {"plain": [], "tls+auth": []}
        for rep in range(args.reps):
            for name in (("plain", "tls+auth") if rep % 2 == 0 else ("tls+auth", "plain")):
                job = f"bench-{name.replace('+', '-')}-{rep}"
                url, security = plain.url, EtcdSecurity()
                if name == "tls+auth":
                    secure.add_job_user(job, f"bench{rep}", password)
                    url, security = secure.url, EtcdSecurity(
                        cacert=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key),
                        user=f"bench{rep}", password=password)
                results[name].append(formation(run_job(url, job, args.workers,
                                                       security.as_env())))
                connects[name] += [connect_s(url, security, f"/elastic/{job}/x")
                                   for _ in range(10)]
        print(f"{args.workers} workers, {args.reps} runs each, alternating; medians (min-max)")
        for name, runs in results.items():
            cells = [f"connect {1000 * statistics.median(connects[name]):.1f} ms"]
            for field in ("join_to_formed_s", "rendezvous_s", "form_s"):
                values = [r[field] for r in runs]
                cells.append(f"{field[:-2]} {1000 * statistics.median(values):.0f} ms "
                             f"({1000 * min(values):.0f}-{1000 * max(values):.0f})")
            print(f"{name:9s} " + "; ".join(cells))
    finally:
        plain.stop()
        secure.stop()


if __name__ == "__main__":
    main()
