"""What each worker's environment holds, from the launcher's spec (no processes started)."""

from __future__ import annotations

import pytest

from elastic.launch.launcher import LaunchSpec

pytestmark = pytest.mark.unit


def spec(nproc: int, env: dict[str, str]) -> LaunchSpec:
    return LaunchSpec(command=("python", "train.py"), target="train.py",
                      etcd="http://127.0.0.1:2379", job_id="j", nproc=nproc, env=env)


def test_several_workers_on_a_node_get_one_intra_op_thread_each_like_under_torchrun():
    two = spec(2, {})
    assert two.caps_threads
    assert [two.worker_env(r)["OMP_NUM_THREADS"] for r in (0, 1)] == ["1", "1"]


def test_a_thread_count_the_user_chose_is_left_alone():
    two = spec(2, {"OMP_NUM_THREADS": "4"})
    assert not two.caps_threads
    assert "OMP_NUM_THREADS" not in two.worker_env(0)  # the inherited "4" stays in force


def test_a_single_worker_keeps_every_core():
    one = spec(1, {})
    assert not one.caps_threads
    assert "OMP_NUM_THREADS" not in one.worker_env(0)


def test_each_worker_gets_its_local_rank_and_the_job_it_belongs_to():
    env = spec(3, {}).worker_env(2)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("2", "3")
    assert (env["ELASTIC_JOB_ID"], env["ELASTIC_ETCD"]) == ("j", "http://127.0.0.1:2379")
