"""Reports what a worker process holds (for the warm-start tests): one JSON line on stdout.

Its random draws, torch's seed, its descriptors, threads, signal handlers and mask, CUDA, its
session and parent, the path it was started by, and fsspec's settings for protocol ``probe``.
"""

import json
import os
import random
import signal
import sys

import fsspec.config
import numpy
import torch

handlers = {}
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGUSR1,
            signal.SIGHUP):
    handler = signal.getsignal(sig)
    handlers[sig.name] = getattr(handler, "__name__", None) or str(handler)
print(json.dumps({
    "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
    "random": random.random(), "numpy": float(numpy.random.random()),
    "torch": float(torch.rand(1)), "torch_seed": torch.initial_seed(),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "handlers": handlers, "mask": sorted(int(s) for s in signal.pthread_sigmask(
        signal.SIG_BLOCK, [])),
    "cuda_initialised": torch.cuda.is_initialized(),
    "started_from": os.environ.get("ELASTIC_STARTED_FROM", "python"),
    "marker": os.environ.get("PROBE_MARKER"),
    "fsspec_probe": fsspec.config.conf.get("probe"),
    "template_threads": len(os.listdir(f"/proc/{os.environ['PROBE_TEMPLATE']}/task"))
    if "PROBE_TEMPLATE" in os.environ else None, "argv": sys.argv, "orig_argv": sys.orig_argv,
}), flush=True)
