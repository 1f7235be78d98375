"""``elastic_worker.py``'s loop under torchrun: TrainState, ElasticSampler, ``--commit-every``.

No ElasticState: it isolates the cost of the state layer (snapshot, sampler, the membership
agreement over an ``AgreementChannel`` on torchrun's store) from the cluster layer. With
``--etcd URL`` each worker also registers an etcd membership (client, keepalive thread, job
watch), to measure what those threads cost alone.
Run it like ``torchrun_worker.py``:
``torchrun --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT
torchrun_trainstate_worker.py --out DIR --steps 400`` (inside ``unshare -n``, see
``bench_recovery.py``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import workload
from elastic.state import ElasticSampler, TrainState
from torchrun_worker import init_group


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--etcd", default="", help="also register an etcd membership here")
    args = p.parse_args()
    init_group()
    if args.etcd:
        register_membership(args.etcd)
    data = workload.dataset()
    model = workload.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    s = TrainState(model=model, optimizer=opt, sampler=ElasticSampler(data, seed=0), epoch=0,
                   step=0)
    s.sampler.set_topology(dist.get_rank(), dist.get_world_size())
    progress = workload.Progress(args.out, f"trainstate-{os.getpid()}")
    ddp = DDP(s.model)
    loader = DataLoader(data, batch_size=args.batch, sampler=s.sampler)
    channel = agreement_channel()
    while s.step < args.steps:
        s.sampler.set_epoch(s.epoch)
        for x, y in loader:
            workload.train_step(ddp, s.optimizer, x, y)
            s.sampler.record_batch(len(x))
            s.step += 1
            progress.step(s.step, dist.get_rank(), dist.get_world_size())
            if s.step % args.commit_every == 0:  # ElasticState.commit's order
                channel.start(False, False)
                s.commit()
                channel.finish()
            if s.step >= args.steps:
                break
        s.epoch += 1
    channel.close()
    dist.destroy_process_group()


def agreement_channel():
    """ElasticState's agreement transport, connected over torchrun's store (after init_group)."""
    from datetime import timedelta

    from elastic.cluster.links.agreement_channel import AgreementChannel

    channel = AgreementChannel(dist.get_rank(), dist.get_world_size(), timedelta(minutes=5))
    channel.connect(dist.distributed_c10d._get_default_store(), "127.0.0.1", 0,
                    timedelta(seconds=60))
    return channel


def register_membership(url: str) -> None:
    """Starts what an ElasticState worker runs beside training: client, keepalive, watch."""
    from datetime import timedelta

    from elastic.cluster.etcd.client import EtcdClient
    from elastic.cluster.rounds.keys import JobKeys
    from elastic.cluster.rounds.membership import EtcdMembership
    from elastic.foundation.timeouts import Timeouts

    membership = EtcdMembership(EtcdClient(url), JobKeys("threads-cost"), "127.0.0.1",
                                Timeouts.from_env({}, lease_ttl=timedelta(seconds=3)))
    membership.register()


if __name__ == "__main__":
    main()
