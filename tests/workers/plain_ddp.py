"""A plain DDP script (no ElasticState): what torchrun would run. Writes one result per rank.

With ``CRASH_RANK`` set, that rank SIGKILLs itself at step 5 of the first generation.

It ends the way torch asks a script to: every rank done (a barrier), the DDP model released,
then ``destroy_process_group``. A gloo group still referenced by a live DDP reducer is destroyed
during interpreter teardown instead, which can abort the process ("terminate called without an
active exception") after it trained correctly.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    loss = model(torch.full((8, 4), float(rank))).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if restart == 0 and step == 5 and str(rank) == os.environ.get("CRASH_RANK"):
        os.kill(os.getpid(), signal.SIGKILL)
flat = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
out = os.path.join(sys.argv[1], f"plain-{rank}.json")
with open(out, "w") as f:
    json.dump({"rank": rank, "world": world, "restart": restart, "params": flat,
               "master": os.environ["MASTER_ADDR"]}, f)
print(f"rank {rank} finished training", file=sys.stderr, flush=True)
dist.barrier()
del model, opt
dist.destroy_process_group()
