"""How fast a joiner is fed the job's state, against the loopback link measured in the same run.

Usage: ``.venv/bin/python benchmarks/bench_joiner_feed.py [--params 100m] [--small] [--reps 2]
[--direct 1,0] [--caps 64] [--landing own,fresh] [--out PATH]`` (``python -m benchmarks
joiner-feed``).

Per rep, in this order: (1) the state transfer, once per packing: three processes in a gloo
group on loopback (rank 0 the source and rank 1 a running worker, both holding the same commit
made in the same round; rank 2 a joiner holding nothing) run what a re-formation runs
(``newest_source``, which names the joiner the only receiver, then ``feed_payload``, the wire of
``TrainState.sync``), then one barrier, the first collective of the next step, on a model of
``--params`` parameters with Adam's state (parameters + two moments: 12 bytes a parameter,
1.2 GB at 100M); (2) the link: a plain TCP socket pair on 127.0.0.1, one process sending the
payload's size in 64 MiB writes to another that receives into a preallocated buffer. Packings:
``--direct`` MiB (a tensor at least this large travels from its own memory; 0: every tensor is
packed, as before) and ``--caps`` MiB (the buckets of the rest). Landings (``--landing``): the
joiner holds its own model and an Adam that has not stepped yet, as a joiner does, and receives
into them where they fit (``own``: what ``TrainState.sync`` does; the moments still land in new
memory), into new memory only (``fresh``: before), or into them after one Adam step, so that the
moments land in place too (``stepped``). Reported: the joiner's bytes/s in the transfer and its
ratio to the link's; the bytes the running worker moved (none); each rank's pause (from the
start to the end of the first collective) against one piece's transfer time; the joiner's CPU
seconds and minor page faults in the transfer (load does not change them: a fault a 4 KiB page
of new memory). Targets (issue 45): ratio >= 0.5; pause <= one bucket. ``--small`` (10M
parameters) runs under load; the claim is the 100M run on an idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHUNK = 64 * 1024 * 1024


def _send(port: int, nbytes: int) -> None:
    data = bytes(CHUNK)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        sent = 0
        while sent < nbytes:
            view = memoryview(data)[:min(CHUNK, nbytes - sent)]
            conn.sendall(view)
            sent += len(view)


def link_bytes_per_s(nbytes: int) -> float:
    """Loopback TCP: one process sends ``nbytes`` to this one; bytes per second received."""
    buffer = bytearray(nbytes)
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = mp.get_context("spawn").Process(target=_send,
                                                 args=(server.getsockname()[1], nbytes))
        sender.start()
        conn, _ = server.accept()
        with conn:
            view, got = memoryview(buffer), 0
            started = time.perf_counter()
            while got < nbytes:
                n = conn.recv_into(view[got:], min(CHUNK, nbytes - got))
                if not n:
                    raise RuntimeError(f"the sender stopped after {got} of {nbytes} bytes")
                got += n
            took = time.perf_counter() - started
        sender.join(60)
    return nbytes / took


def _state(params: int, stepped: bool) -> dict:
    """A model of ``params`` parameters (square Linear layers) and its Adam, built as a user's
    script builds them, stepped once (zero gradients) for ``stepped``: the source's state
    (Adam's moments exist) or the tensors a joiner's state may land in."""
    import torch  # noqa: PLC0415 (in the ranks only)
    width = 2048
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)))
    opt = torch.optim.Adam(model.parameters())
    if stepped:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _rank(rank: int, port: int, params: int, variants: list[tuple[int, int, str]],
          results: mp.Queue) -> None:
    import torch.distributed as dist  # noqa: PLC0415
    sys.path.insert(0, str(REPO))
    from elastic.state.feed import Packing, feed_payload  # noqa: PLC0415
    from elastic.state.sync import newest_source  # noqa: PLC0415
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3, timeout=datetime.timedelta(minutes=10))
    payload = _state(params, stepped=True) if rank == 0 else None
    version, lineage = (2, 7) if rank < 2 else (1, 0)  # the joiner: no round behind it
    owns = {landing: _state(params, landing == "stepped") for landing in {v[2] for v in variants}
            if rank == 2 and landing != "fresh"}
    for direct, cap, landing in variants:
        dist.barrier()
        faults, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
        started = time.perf_counter()
        source = newest_source(version, lineage=lineage)
        fed = feed_payload(payload, source.rank, source.receivers,
                           packing=Packing(direct_bytes=direct, cap_bytes=cap),
                           into=owns.get(landing))
        transferred = time.perf_counter()
        cpu, faults = (time.process_time() - cpu,
                       resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        dist.barrier()  # the first collective of the next step
        first = time.perf_counter()
        results.put({"rank": rank, "variant": _name(direct, cap, landing),
                     "s": transferred - started,
                     "pause_s": first - started, "moved": fed.nbytes, "cpu_s": cpu,
                     "faults": faults,
                     "bytes": sum(t.numel() * t.element_size() for t in _tensors(fed.payload))})
        del fed
    dist.destroy_process_group()


def _tensors(value: object) -> list:
    import torch  # noqa: PLC0415
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _name(direct: int, cap: int, landing: str) -> str:
    return (f"{landing}, direct >= {direct >> 20} MiB, buckets {cap >> 20} MiB" if direct < 2**62
            else f"{landing}, all packed, buckets {cap >> 20} MiB")


def transfer(params: int, variants: list[tuple[int, int, str]]) -> list[dict]:
    """One transfer per variant (packing) among three ranks; every rank's figures."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    ranks = [ctx.Process(target=_rank, args=(r, port, params, variants, results))
             for r in range(3)]
    for proc in ranks:
        proc.start()
    figures = [results.get(timeout=1800) for _ in range(3 * len(variants))]
    for proc in ranks:
        proc.join(120)
    return figures


def _parse_count(raw: str) -> int:
    raw = raw.lower()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(raw[-1], 1)
    return int(float(raw.rstrip("kmg")) * scale)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="100m", help="model parameters (100m: 1.2 GB with Adam)")
    p.add_argument("--small", action="store_true", help="10M parameters: runs under load")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--caps", default="64", help="bucket caps of the packed tensors, MiB")
    p.add_argument("--direct", default="1,0",
                   help="tensors at least this large (MiB) travel alone, from their own "
                        "memory (0: all packed)")
    p.add_argument("--landing", default="own,fresh",
                   help="where the joiner receives: own (its model and unstepped Adam, where "
                        "they fit), fresh (new memory), stepped (its model and stepped Adam)")
    p.add_argument("--out", default=str(REPO / "runs" / "joiner-feed.json"))
    args = p.parse_args()
    params = 10**7 if args.small else _parse_count(args.params)
    unknown = set(args.landing.split(",")) - {"own", "fresh", "stepped"}
    if unknown:
        p.error(f"--landing takes own, fresh and stepped, not {sorted(unknown)}")
    variants = [(int(d) << 20 if int(d) else 2**62, int(c) << 20, landing)
                for landing in args.landing.split(",")
                for d in args.direct.split(",") for c in args.caps.split(",")]
    reps = []
    for rep in range(args.reps):
        figures = transfer(params, variants if rep % 2 == 0 else variants[::-1])
        nbytes = next(f["bytes"] for f in figures if f["rank"] == 2)
        link = link_bytes_per_s(nbytes)
        row = {"bytes": nbytes, "link_bytes_per_s": link, "variants": {}}
        for direct, cap, landing in variants:
            name = _name(direct, cap, landing)
            joiner, running, source = (next(f for f in figures
                                            if f["rank"] == r and f["variant"] == name)
                                       for r in (2, 1, 0))
            pieces = _pieces(params, direct, cap)
            row["variants"][name] = {
                "joiner_bytes_per_s": nbytes / joiner["s"], "ratio": nbytes / joiner["s"] / link,
                "transfer_s": joiner["s"], "running_moved_bytes": running["moved"],
                "running_pause_s": running["pause_s"], "source_pause_s": source["pause_s"],
                "joiner_pause_s": joiner["pause_s"], "one_piece_s": joiner["s"] / pieces,
                "joiner_cpu_s": joiner["cpu_s"], "joiner_page_faults": joiner["faults"],
                "pieces": pieces}
        reps.append(row)
        print(json.dumps(row), flush=True)
    _table(reps, [_name(*v) for v in variants])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cores": os.cpu_count(), "params": params,
                                          "reps": reps}, indent=1))


def _pieces(params: int, direct: int, cap: int) -> int:
    """Messages of the model's tensors (the largest ones: a layer's weight and its two Adam
    moments; the small ones are a few bytes)."""
    width = 2048
    tensors, each = 3 * max(1, round(params / (width * width))), width * width * 4
    if each >= direct:
        return tensors
    return max(1, -(-tensors * each // cap))


def _table(reps: list[dict], names: list[str]) -> None:
    print(f"\n{'variant':>42}{'joiner GB/s':>12}{'link GB/s':>10}{'ratio':>6}"
          f"{'running moved':>14}{'pause s: running':>17}{'source':>7}{'1 piece s':>10}"
          f"{'joiner cpu s':>13}{'faults':>8}")
    link = statistics.median(r["link_bytes_per_s"] for r in reps) / 1e9
    for key in names:
        rows = [r["variants"][key] for r in reps]

        def med(field: str, rows: list[dict] = rows) -> float:
            return statistics.median(r[field] for r in rows)
        print(f"{key:>42}{med('joiner_bytes_per_s') / 1e9:>12.2f}{link:>10.2f}"
              f"{med('ratio'):>6.2f}{int(med('running_moved_bytes')):>14}"
              f"{med('running_pause_s'):>17.2f}{med('source_pause_s'):>7.2f}"
              f"{med('one_piece_s'):>10.3f}{med('joiner_cpu_s'):>13.2f}"
              f"{int(med('joiner_page_faults')):>8}")


if __name__ == "__main__":
    main()
