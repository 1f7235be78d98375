"""What each worker's environment holds, from the launcher's spec (no processes started)."""

from __future__ import annotations

import pytest

from elastic.cluster.links.interfaces import interface_of, socket_interface_env
from elastic.cluster.rounds.keys import JobKeys, check_job_id
from elastic.foundation.errors import AdvertiseAddressError
from elastic.launch.cli import _fresh_job_id
from elastic.launch.launch_spec import LaunchSpec
from elastic.foundation.settings import EtcdSecurity

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


def test_workers_listen_on_the_interface_of_the_advertised_address_only():
    env = spec(1, {}).worker_env(0)
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("lo", "=lo")
    assert interface_of("127.0.0.1") == "lo" and interface_of("::1") == "lo"


def test_an_interface_the_user_chose_is_left_alone():
    assert socket_interface_env("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth9"}) == \
        {"NCCL_SOCKET_IFNAME": "=lo"}
    assert "GLOO_SOCKET_IFNAME" not in spec(1, {"GLOO_SOCKET_IFNAME": "eth9"}).worker_env(0)


def test_an_advertised_address_of_no_interface_here_is_refused_naming_the_flag():
    with pytest.raises(AdvertiseAddressError, match="--advertise-addr"):
        interface_of("192.0.2.254")
    with pytest.raises(AdvertiseAddressError, match="not an IP address"):
        interface_of("my-host")


def test_workers_get_the_tls_files_and_user_as_variables_and_the_password_only_there(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    security = EtcdSecurity(cacert=str(ca), user="alice", password="pw")
    launch = LaunchSpec(command=("python", "train.py"), target="train.py",
                        etcd="https://127.0.0.1:2379", job_id="j", security=security)
    env = launch.worker_env(0)
    assert (env["ELASTIC_ETCD_CACERT"], env["ELASTIC_ETCD_USER"]) == (str(ca), "alice")
    assert env["ELASTIC_ETCD_PASSWORD"] == "pw" and env["ELASTIC_ETCD_CERT"] == ""
    assert "pw" not in launch.command and "pw" not in security.as_flags()


def test_job_ids_are_checked_before_they_become_key_prefixes():
    for good in ("job-1", "run.7_b", "A" * 64, _fresh_job_id()):
        assert check_job_id(good) == good
    for bad in ("", "-x", ".hidden", "a/b", "a b", "ü", "x" * 65, "../x"):
        with pytest.raises(ValueError):
            check_job_id(bad)
    assert JobKeys("job-1").launchers().prefix == "/elastic/job-1.launchers/"
    # a job named for another's launchers would read and write their keys (who is in it)
    for taken in ("job-1.launchers", "job-1.launchers.launchers"):
        with pytest.raises(ValueError, match="launchers"):
            check_job_id(taken)
        with pytest.raises(ValueError, match="launchers"):
            JobKeys(taken)
