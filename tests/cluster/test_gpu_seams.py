"""The GPU path's decisions, checked without a GPU: the NCCL environment set before a group is
made, which GPU a worker takes, an abort that never runs on the caller's thread, and a dry run of
the script that checks them on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from elastic.cluster.links import device
from elastic.cluster.links.device import ASYNC_ERROR_HANDLING, claim_device, nccl_env
from elastic.cluster.links.process_group import ProcessGroup
from elastic.foundation.errors import DeviceUnavailableError

pytestmark = pytest.mark.timeout(60)
S = timedelta(seconds=1)


def test_in_process_abort_turns_nccls_own_error_handling_off_unless_the_user_chose():
    assert nccl_env({}) == {ASYNC_ERROR_HANDLING: "0"}
    assert nccl_env({ASYNC_ERROR_HANDLING: "3"}) == {}
    assert nccl_env({ASYNC_ERROR_HANDLING: "0"}) == {}


def test_local_rank_wins_when_it_is_set(tmp_path):
    assert claim_device({"LOCAL_RANK": "3"}, 4, tmp_path).index == 3


def test_a_local_rank_beyond_the_visible_gpus_names_the_fix(tmp_path):
    with pytest.raises(DeviceUnavailableError, match="LOCAL_RANK=2 but this process sees 2"):
        claim_device({"LOCAL_RANK": "2"}, 2, tmp_path)


def test_no_gpu_at_all_is_an_error_that_points_to_gloo(tmp_path):
    with pytest.raises(DeviceUnavailableError, match="--backend gloo"):
        claim_device({}, 0, tmp_path)


def test_one_visible_gpu_needs_no_claim(tmp_path):
    claim = claim_device({}, 1, tmp_path)
    assert (claim.index, claim.lock_fd) == (0, None)


_CLAIMER = """
import sys
from pathlib import Path
from elastic.cluster.links.device import claim_device
claim = claim_device({}, int(sys.argv[2]), Path(sys.argv[1]))
print(claim.index, flush=True)
sys.stdin.read()  # holds the claim until the test closes stdin
"""


def _claimer(lock_dir: Path, gpus: int) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    return subprocess.Popen([sys.executable, "-c", _CLAIMER, str(lock_dir), str(gpus)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_workers_started_by_hand_without_local_rank_take_different_gpus(tmp_path):
    workers = [_claimer(tmp_path, 3) for _ in range(3)]
    try:
        indices = [int(w.stdout.readline()) for w in workers]
        assert sorted(indices) == [0, 1, 2]
        extra = _claimer(tmp_path, 3)
        _, err = extra.communicate(timeout=30)
        assert extra.returncode != 0 and "all 3 GPUs of this host are held" in err
    finally:
        for worker in workers:
            worker.communicate(timeout=30)  # closes stdin: the worker ends


def test_a_dead_workers_gpu_is_free_for_the_next_one(tmp_path):
    first = _claimer(tmp_path, 2)
    assert int(first.stdout.readline()) == 0
    first.kill()  # ends however it ends: the kernel lets go of its claim
    first.communicate(timeout=30)
    second = _claimer(tmp_path, 2)
    try:
        assert int(second.stdout.readline()) == 0
    finally:
        second.communicate(timeout=30)


def test_an_nccl_group_needs_its_gpu_chosen_before_it_forms():
    with pytest.raises(ValueError, match="device_index"):
        ProcessGroup("nccl", 60 * S, frozenset(), 5 * S)


def test_an_nccl_abort_runs_off_the_releasing_thread_and_destroy_waits_for_it():
    """``release`` is called on the etcd client's event loop: the abort must not block it."""
    aborting = threading.Event()
    finish = threading.Event()
    ran_on: list[str] = []

    def slow_abort() -> None:
        ran_on.append(threading.current_thread().name)
        aborting.set()
        finish.wait(30)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = ProcessGroup("nccl", 60 * S, frozenset(), 5 * S, device_index=0, abort=slow_abort)
    try:
        group.release("member m1 is gone")  # returns while the abort is still running
        assert aborting.wait(10) and not finish.is_set()
        assert group.is_released and ran_on == ["elastic-nccl-abort"]
        finish.set()
        group.destroy()
        assert not dist.is_initialized()
    finally:
        finish.set()
        if dist.is_initialized():
            dist.destroy_process_group()


class _Stop(Exception):
    """Ends a formation at the point the test looks at."""


def test_an_nccl_group_forms_on_its_gpu_eagerly_with_nccls_error_handling_off(monkeypatch):
    from elastic.cluster.links import process_group

    seen: dict = {}
    monkeypatch.delenv(ASYNC_ERROR_HANDLING, raising=False)
    monkeypatch.setattr(process_group.torch.cuda, "set_device",
                        lambda d: seen.setdefault("set_device", d))

    def init(backend, **kwargs):
        seen.update(backend=backend, env=os.environ.get(ASYNC_ERROR_HANDLING),
                    device_id=kwargs.get("device_id"))
        raise _Stop

    monkeypatch.setattr(process_group.dist, "init_process_group", init)
    group = ProcessGroup("nccl", 60 * S, frozenset(), 5 * S, device_index=2)
    with pytest.raises(_Stop):
        group.form(dist.HashStore(), 0, 2)
    assert seen["env"] == "0", "the variable must be set before the group is made"
    assert str(seen["device_id"]) == "cuda:2" and str(seen["set_device"]) == "cuda:2"


def test_the_gpu_check_script_runs_its_cycles_on_the_cpu_and_refuses_an_unknown_part(tmp_path):
    """``benchmarks/gpu_check.py`` is run by hand on GPU machines; its dry run on the CPU keeps
    it from rotting between those runs."""
    repo = Path(__file__).resolve().parents[2]
    script = [sys.executable, str(repo / "benchmarks" / "gpu_check.py"), "--backend", "gloo",
              "--cycles", "2", "--out", str(tmp_path)]
    ran = subprocess.run(script + ["--parts", "versions,cycles,release"], capture_output=True,
                         text=True, timeout=50, check=False)
    assert ran.returncode == 0 and "every check passed" in ran.stdout, ran.stdout + ran.stderr
    report = json.loads((tmp_path / "gpu-check-versions-cycles-release.json").read_text())
    assert report["cycles"]["summary"]["all_results_ok"] is True
    assert len(report["cycles"]["rows"]) == 2

    refused = subprocess.run(script + ["--parts", "cycles,nonsense"], capture_output=True,
                             text=True, timeout=50, check=False)
    assert refused.returncode == 2 and "unknown parts ['nonsense']" in refused.stderr


def _gpu_fsdp(tmp_path, *args: str) -> subprocess.CompletedProcess:
    repo = Path(__file__).resolve().parents[2]
    script = [sys.executable, str(repo / "benchmarks" / "gpu_fsdp.py"), "--device", "cpu",
              "--out", str(tmp_path), *args]
    return subprocess.run(script, capture_output=True, text=True, timeout=110, check=False)


@pytest.mark.timeout(120)  # seconds when idle; a loaded machine starts its processes slowly
def test_the_gpu_fsdp_script_times_the_sharded_commit_and_its_buddy_send_on_the_cpu(tmp_path):
    """``benchmarks/gpu_fsdp.py`` runs on a lent GPU only; its dry run on the CPU (tiny sizes)
    keeps the refresh and buddy parts from rotting between those runs."""
    ran = _gpu_fsdp(tmp_path, "--parts", "versions,refresh,buddy", "--width", "32",
                    "--buddy-width", "32", "--layers", "2", "--batch", "8", "--rounds", "1",
                    "--buddy-rounds", "1", "--steps", "4", "--commit-every", "2", "--copies", "1")
    assert ran.returncode == 0 and "every check passed" in ran.stdout, ran.stdout + ran.stderr
    refresh = json.loads((tmp_path / "gpu-fsdp-refresh.json").read_text())
    assert refresh["host_copy_equals_device"] is True and len(refresh["pairs"]) == 1
    # the parameters, two moments each, and AdamW's step count of each (a float32)
    assert refresh["commit_mib"] * 2**20 == 2 * (32 * 32 + 32) * 4 * 3 + 4 * 4
    buddy = json.loads((tmp_path / "gpu-fsdp-buddy.json").read_text())
    assert buddy["rank0"]["holds_buddys_shard_bit_for_bit"] is True
    assert buddy["rank1"]["bytes_sent"] > 0


@pytest.mark.timeout(120)
def test_the_gpu_fsdp_script_runs_the_example_under_elastic_run_on_the_cpu(tmp_path):
    ran = _gpu_fsdp(tmp_path, "--parts", "example", "--example-size", "tiny",
                    "--example-epochs", "1", "--example-text-bytes", "4000")
    assert ran.returncode == 0 and "every check passed" in ran.stdout, ran.stdout + ran.stderr
    found = json.loads((tmp_path / "gpu-fsdp-example.json").read_text())
    assert found["compute_dtype"] == "float32" and found["durable_checkpoint_written"] is True
    assert found["loss_last"] < found["loss_first"] and found["steps_per_s"] > 0
