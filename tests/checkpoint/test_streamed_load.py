"""Loading and verifying a checkpoint from an object store streams it: the memory a load needs
is the payload once plus a chunk or two, and a verification holds a chunk or two only.

Measured in a fresh process (its own peak RSS, reset with ``/proc/self/clear_refs``) on
``memory://``, which takes the object-store path (not a local file: no memory-mapping of the
stored file itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

PAYLOAD = 64 << 20

MEASURE = """
import gc, json, sys, torch
from elastic.checkpoint import CheckpointStore
from elastic.checkpoint.payload import verify_payload

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith(key + ":"))

def peak_growth(call):
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current RSS
    base = status("VmRSS")
    result = call()
    return status("VmHWM") - base, result

store = CheckpointStore("memory://streamed/run", keep=None)
store.save(1, {"w": torch.randn(int(sys.argv[1]) // 4)})
ref = store.latest()
[(name, entry)] = ref.manifest.files.items()
path = store._storage.join("000000000001", name)
verified, _ = peak_growth(lambda: verify_payload(store._storage, path, entry))
loaded, _ = peak_growth(lambda: float(store.load(ref).state_dict["w"].sum()))
print(json.dumps({"verify": verified, "load": loaded}))
"""


def measure() -> dict[str, int]:
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs /proc/self/clear_refs to reset the peak RSS (Linux)")
    out = subprocess.run([sys.executable, "-c", MEASURE, str(PAYLOAD)], check=True,
                         capture_output=True, text=True, timeout=100)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_from_an_object_store_holds_the_payload_once_and_verifying_holds_a_chunk() -> None:
    growth = measure()
    assert growth["load"] < PAYLOAD * 1.5, growth  # a whole download plus its tensors: 2x
    assert growth["verify"] < PAYLOAD / 2, growth  # a whole download: 1x
