"""A worker whose DDP all-reduce finishes after ``backward()`` returns, as NCCL's does.

Its communication hook hands DDP a future that is complete at once (NCCL's: "enqueued") and
has a helper thread all-reduce each bucket in place afterwards (``gradient_as_bucket_view``:
the gradients are the buckets), one bucket after the other in DDP's order. Each bucket's real
completion is a future given to ``state.track_collective`` (not with ``--untracked``). After each
step's ``commit_step()`` block the loop waits for the helper thread to go idle, as the next
step's collectives would queue behind the reduction on NCCL's stream: without that, DDP's own
collectives of the next forward (its bucket rebuild) could meet a late bucket's all-reduce in
another order on each rank. Float64,
each rank its own inputs, ``commit_step()`` around every step. Worker ``--victim`` makes its
last bucket of step ``--kill-step`` slow by ``--slow-s`` and SIGKILLs itself inside that step's
``commit_step()`` block: after it voted, before its reduction is done unless the vote waited
for it. The final parameters go to ``result-{index}.json``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import queue
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic import ElasticState
from tests.workers.markers import write_marker
from tests.workers.sync_points import wait_for_peers


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-step", type=int, default=4)
    p.add_argument("--victim", type=int, default=2)
    p.add_argument("--slow-s", type=float, default=3.0)
    p.add_argument("--untracked", action="store_true")
    return p.parse_args()


class BucketReducer:
    """A round's helper thread that all-reduces DDP's buckets in place, in the order given."""

    def __init__(self, slow: threading.Event) -> None:
        self.group = dist.group.WORLD  # this round's: a late bucket never reaches the next group
        self.world = dist.get_world_size()
        self.slow = slow  # set: this process's next last bucket is slow
        self.slow_s = 0.0
        self.work: queue.Queue = queue.Queue()
        self.broken: RuntimeError | None = None  # once a reduction failed, none is started
        threading.Thread(target=self._run, daemon=True, name="bucket-reducer").start()

    def hook(self, state: ElasticState, untracked: bool):
        def reduce_later(_, bucket):  # DDP rejects the annotations as strings (__future__)
            done = torch.futures.Future()
            if not untracked:
                state.track_collective(done)
            self.work.put((bucket.buffer(), done, bucket.is_last()))
            enqueued = torch.futures.Future()
            enqueued.set_result(bucket.buffer())
            return enqueued
        return reduce_later

    def _run(self) -> None:
        while True:
            buffer, done, last = self.work.get()
            if last and self.slow.is_set():
                self.slow.clear()
                threading.Event().wait(self.slow_s)  # a slow all-reduce, not a synchronisation
            try:
                self._reduce(buffer, done)
            finally:
                self.work.task_done()

    def _reduce(self, buffer: torch.Tensor, done: torch.futures.Future) -> None:
        if self.broken is not None:
            done.set_exception(self.broken)
            return
        try:
            dist.all_reduce(buffer, group=self.group)
            buffer.div_(self.world)
            done.set_result(buffer)
        except RuntimeError as exc:  # the group broke or was released
            self.broken = exc
            done.set_exception(exc)

    def drain(self) -> None:
        """Returns once every bucket handed over so far was reduced (or failed)."""
        self.work.join()


def main() -> None:
    args = parse()
    out, index = Path(args.out), int(os.environ["TEST_WORKER_INDEX"])
    faulthandler.register(signal.SIGUSR1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1)).double()
    state = ElasticState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                         step=0)
    slow = threading.Event()

    def train(s: ElasticState) -> None:
        reducer = BucketReducer(slow)
        reducer.slow_s = args.slow_s
        ddp = DDP(s.model, bucket_cap_mb=0.0001, gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, reducer.hook(s, args.untracked))
        while s.step < args.steps:
            victim_now = index == args.victim and s.step + 1 == args.kill_step
            if victim_now:
                slow.set()
            g = torch.Generator().manual_seed(1000 * s.step + s.rank)
            x = torch.randn(16, 8, generator=g, dtype=torch.float64)
            s.optimizer.zero_grad()
            ddp(x).pow(2).mean().backward()
            with s.commit_step():
                if victim_now:
                    write_marker(out / f"fired-kill-{index}", {"step": s.step + 1})
                    os.kill(os.getpid(), signal.SIGKILL)
                s.optimizer.step()
                s.step += 1
            reducer.drain()

    wait_for_peers(out, index)
    state.run(train)
    params = [p.detach().flatten().tolist() for p in state.model.parameters()]
    (out / f"result-{index}.json").write_text(json.dumps({"step": state.step, "params": params}))
    if args.untracked:
        # Untracked, a broken round's reducer thread may still be inside gloo: ending without
        # the interpreter's teardown keeps its destructors from aborting the process under it.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
