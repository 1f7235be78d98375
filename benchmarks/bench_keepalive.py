"""What renewing leases costs etcd and the client: one stream per connection against aetcd's
stream per renewal.

Usage: ``.venv/bin/python benchmarks/bench_keepalive.py [--clients 100] [--interval 0.15]
[--seconds 10] [--rounds 2] [--out benchmarks/results/keepalive-DATE.json]``.

A fresh etcd on 127.0.0.1; ``--clients`` clients (each its own connection and loop thread, as
each worker of a job has), each with one lease that a thread of its own renews every
``--interval`` seconds, as a member's keepalive thread does. Two ways of renewing take turns,
``--rounds`` times each, on the same etcd and clients:

- ``one stream``: ``EtcdClient.refresh``, every renewal of a connection on one LeaseKeepAlive
  stream;
- ``stream per renewal`` (the anchor): aetcd's ``refresh_lease``, which opens a stream for each.

Measured over ``--seconds`` after a second of warm-up: renewals per second, and CPU seconds per
renewal of etcd (``/proc/PID/stat``) and of this process (all clients), and the LeaseKeepAlive
streams etcd opened (its ``/metrics``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.etcd_observation import etcd_cpu_s, etcd_metrics  # noqa: E402
from elastic.cluster.etcd.client import EtcdClient  # noqa: E402
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402


def streams_opened(url: str) -> float:
    """LeaseKeepAlive streams etcd has opened so far (its ``/metrics``)."""
    return etcd_metrics(url).get("keepalive_streams_opened", 0.0)


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def per_renewal_stream(client: EtcdClient, lease: int) -> int:
    """aetcd's own renewal: a LeaseKeepAlive stream opened and closed for it."""
    reply = client._call(lambda c: c.refresh_lease(lease), "lease keepalive")  # noqa: SLF001
    return int(reply.TTL)


def measure(how: str, etcd: EmbeddedEtcd, clients: list[EtcdClient], leases: list[int],
            interval_s: float, seconds: float) -> dict[str, float | str]:
    renew = (lambda c, lease: c.refresh(lease)) if how == "one stream" else per_renewal_stream
    stop, counts = threading.Event(), [0] * len(clients)
    in_flight = [threading.Lock() for _ in clients]

    def keep(i: int) -> None:
        while not stop.wait(interval_s):  # the renewal period, as a member's keepalive
            with in_flight[i]:
                renew(clients[i], leases[i])
                counts[i] += 1

    def snapshot() -> tuple[float, float, float, int]:
        """Both ends of the window with no renewal in flight, so that a stream etcd opened
        and the renewal it served fall on the same side."""
        with contextlib.ExitStack() as held:
            for lock in in_flight:
                held.enter_context(lock)
            return (etcd_cpu_s(etcd.process.pid), own_cpu_s(), streams_opened(etcd.url),
                    sum(counts))

    threads = [threading.Thread(target=keep, args=(i,), daemon=True) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    stop.wait(1.0)  # warm-up: every stream opened, every thread in its period
    etcd0, own0, streams0, done0 = snapshot()
    started = time.monotonic()
    stop.wait(seconds)  # the window measured, not a synchronisation
    elapsed = time.monotonic() - started
    etcd1, own1, streams1, done1 = snapshot()
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    renewals = max(1, done1 - done0)
    return {"how": how, "renewals_per_s": round(renewals / elapsed, 1),
            "etcd_cpu_us_per_renewal": round((etcd1 - etcd0) / renewals * 1e6, 1),
            "client_cpu_us_per_renewal": round((own1 - own0) / renewals * 1e6, 1),
            "streams_opened_per_renewal": round((streams1 - streams0) / renewals, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.15,
                        help="seconds between one client's renewals")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    etcd = EmbeddedEtcd(niceness=0, go_max_procs=None).start()
    clients = [EtcdClient(etcd.url) for _ in range(args.clients)]
    try:
        leases = [c.grant(timedelta(seconds=60)) for c in clients]
        results = []
        for _ in range(args.rounds):
            for how in ("stream per renewal", "one stream"):
                result = measure(how, etcd, clients, leases, args.interval, args.seconds)
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        for client in clients:
            client.close()
        etcd.stop()
    record = {"cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
              "clients": args.clients, "interval_s": args.interval, "seconds": args.seconds,
              "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
