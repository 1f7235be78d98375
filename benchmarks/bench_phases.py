"""Where steady-state time goes: the state layer and the etcd client, A/B in the same processes.

Usage: ``.venv/bin/python benchmarks/bench_phases.py [--cycles 6] [--phase-steps 300]``.

Separate runs of two programs differ in more than the code under test (memory layout, what
the neighbours on a shared machine do at that minute). Here two torchrun workers train one DDP
model and alternate, in the same processes, between phases of:

- ``plain``: the plain DDP loop with ``DistributedSampler`` (what ``torchrun_worker.py`` runs);
- ``state``: the loop of ``elastic_worker.py``: ``ElasticSampler`` with ``record_batch``,
  ``TrainState`` values, and every 10 steps ``ElasticState.commit``'s work: the flags handed to
  the ``AgreementChannel``, the snapshot copied, then the agreement's answer;
- ``state-all-reduce``: the same with the agreement as it was before the ``AgreementChannel``,
  a 2-integer gloo all-reduce started before the snapshot and waited for after it;
- ``state-no-agreement``: the same without any agreement.

Every cycle runs each phase once (order reversed every other cycle); then each worker registers
an etcd membership (client, keepalive and watch threads) and the cycles run again. Rank 0 prints
the median steps/s of each phase and its main thread's CPU time per step. Runs inside
``unshare -n`` like ``bench_recovery.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("plain", "state", "state-all-reduce", "state-no-agreement")


def drive(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE.parent))
    from bench_recovery import env_for
    from elastic.cluster.links.ports import free_port
    from elastic.launch.embedded_etcd import EmbeddedEtcd

    etcd = EmbeddedEtcd().start()
    try:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                        "--nproc-per-node=2", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{free_port()}", __file__, "--worker",
                        "--etcd", etcd.url, "--cycles", str(args.cycles),
                        "--phase-steps", str(args.phase_steps)],
                       env=env_for(), cwd=HERE, check=True, timeout=1800)
    finally:
        etcd.stop()


def work(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import workload
    from elastic.state import ElasticSampler, TrainState
    from torchrun_trainstate_worker import agreement_channel, register_membership
    from torchrun_worker import init_group

    init_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = workload.dataset()
    s = TrainState(model=workload.model(), sampler=ElasticSampler(data, seed=0), epoch=0, step=0)
    s.register("optimizer", torch.optim.SGD(s.model.parameters(), lr=0.01, momentum=0.9))
    s.sampler.set_topology(rank, world)
    ddp = DDP(s.model)
    plain_sampler = DistributedSampler(data, seed=0)
    plain_loader = DataLoader(data, batch_size=32, sampler=plain_sampler)

    def plain_batches():
        for epoch in range(10**6):
            plain_sampler.set_epoch(epoch)
            yield from plain_loader

    def state_batches():
        while True:
            s.sampler.set_epoch(s.epoch)
            yield from DataLoader(data, batch_size=32, sampler=s.sampler)
            s.epoch += 1

    sources = {"plain": plain_batches(), "state": state_batches()}

    channel = agreement_channel()

    def start_agreement(kind: str):  # returns the function that waits for the answer
        if kind == "state":
            channel.start(False, False)
            return channel.finish
        flags = torch.tensor([0, 0], dtype=torch.int32)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        return lambda: (work.wait(), flags.tolist())

    def phase(kind: str) -> tuple[float, float]:
        batches = sources["plain" if kind == "plain" else "state"]
        dist.barrier()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(args.phase_steps):
            x, y = next(batches)
            workload.train_step(ddp, s.optimizer, x, y)
            if kind == "plain":
                continue
            s.sampler.record_batch(len(x))
            s.step += 1
            if s.step % 10 == 0:
                finish = None if kind == "state-no-agreement" else start_agreement(kind)
                s.commit()
                if finish is not None:
                    finish()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        return args.phase_steps / wall, cpu / args.phase_steps * 1000

    results: dict[str, list[tuple[float, float]]] = {}

    def cycles(tag: str) -> None:
        for cycle in range(args.cycles):
            for kind in PHASES[:: 1 if cycle % 2 == 0 else -1]:
                results.setdefault(f"{tag} {kind}", []).append(phase(kind))

    phase("plain")  # warm-up
    cycles("without etcd")
    register_membership(args.etcd)
    cycles("with etcd")
    if rank == 0:
        print("| phase | steps/s, median | all cycles | main-thread CPU ms/step |")
        print("|---|---:|---|---:|")
        for key, values in results.items():
            rates = [r for r, _ in values]
            print(f"| {key} | {statistics.median(rates):.1f} | "
                  f"{', '.join(f'{r:.1f}' for r in rates)} | "
                  f"{statistics.median(c for _, c in values):.2f} |", flush=True)
    channel.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=6)
    parser.add_argument("--phase-steps", type=int, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--etcd", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        work(args)
        return
    if os.environ.get("BENCH_NETNS") != "1":
        inner = (f"ip link set lo up && exec {sys.executable} {Path(__file__)} "
                 f"--cycles {args.cycles} --phase-steps {args.phase_steps}")
        os.execvpe("unshare", ["unshare", "-n", "sh", "-c", inner],
                   dict(os.environ, BENCH_NETNS="1"))
    drive(args)


if __name__ == "__main__":
    main()
