"""The etcd client against a real etcd with TLS (client certificates required) and auth on.

One server for the module: a CA, server and client certificates made in a temp dir, a root
user and one user per job whose role reads and writes that job's prefixes only. Every refusal
ends in ``EtcdAccessError``: one sentence naming the problem and the setting that fixes it,
at once (a refusal does not pass by retrying).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from elastic.cluster.etcd.client import EtcdClient, uses_tls
from elastic.cluster.etcd.key_range import KeyRange
from elastic.cluster.rounds.keys import JobKeys
from elastic.foundation.errors import EtcdAccessError
from elastic.launch.embedded_etcd import find_etcd_binary
from elastic.foundation.settings import EtcdSecurity
from tests.support.tls_etcd import JOB_A, JOB_B, JOB_USERS, ROOT_PASSWORD, Pki, SecureEtcd

pytestmark = pytest.mark.timeout(120)
PASSWORDS = dict(JOB_USERS.values())
# A refusal is not retried: one that was would be retried for an hour, and the test would hang
# until pytest-timeout ends it.
RETRY_FOR = timedelta(hours=1)
WAIT_S = 10.0  # a hang guard for events that come at once


def tls(pki: Pki, **changes: str) -> dict[str, str]:
    return {"cacert": str(pki.ca), "cert": str(pki.client_cert), "key": str(pki.client_key),
            **changes}


def as_user(pki: Pki, user: str, **changes: str) -> EtcdSecurity:
    return EtcdSecurity(**tls(pki, **changes), user=user, password=PASSWORDS[user])


def refusal(server: SecureEtcd, security: EtcdSecurity,
            key: str = f"/elastic/{JOB_A}/x") -> str:
    """Writes ``key`` and returns the refusal's message (a retried refusal hangs: RETRY_FOR)."""
    client = EtcdClient(server.url, security=security, retry_for=RETRY_FOR)
    try:
        with pytest.raises(EtcdAccessError) as refused:
            client.put(key, "v")
    finally:
        client.close()
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_the_right_ca_certificate_and_user_read_and_write_the_users_own_job(secure_etcd, pki):
    client = EtcdClient(secure_etcd.url, security=as_user(pki, "alice"))
    try:
        keys = JobKeys(JOB_A)
        client.put(keys.config, "{}")
        assert client.get(keys.config).value == b"{}"
        lease = client.grant(timedelta(seconds=5))
        client.put(keys.member("m"), "x", lease=lease)
        assert client.revoke(lease)
        assert client.get(keys.member("m")) is None
        assert not client.revoke(lease), "a lease revoked twice must say it was gone"
    finally:
        client.close()


def test_a_wrong_ca_names_the_ca_flag(secure_etcd, pki):
    message = refusal(secure_etcd, as_user(pki, "alice", cacert=str(pki.other_ca)))
    assert "not trusted" in message and "--etcd-cacert" in message and str(pki.other_ca) in message


def test_an_expired_client_certificate_is_named_with_its_expiry(secure_etcd, pki):
    message = refusal(secure_etcd, as_user(pki, "alice", cert=str(pki.expired_cert),
                                           key=str(pki.expired_key)))
    assert "expired on" in message and str(pki.expired_cert) in message
    assert "renew" in message


def test_a_missing_client_certificate_is_asked_for(secure_etcd, pki):
    security = EtcdSecurity(cacert=str(pki.ca), user="alice", password=PASSWORDS["alice"])
    message = refusal(secure_etcd, security)
    assert "requires a client certificate" in message and "--etcd-cert" in message


def test_a_wrong_password_names_the_user_and_where_the_password_comes_from(secure_etcd, pki):
    security = EtcdSecurity(**tls(pki), user="alice", password="not-it")
    message = refusal(secure_etcd, security)
    assert "'alice'" in message and "--etcd-password-file" in message
    assert "not-it" not in message


def test_a_user_cannot_read_or_write_another_jobs_keys(secure_etcd, pki):
    alice = EtcdClient(secure_etcd.url, security=as_user(pki, "alice"))
    bob = EtcdClient(secure_etcd.url, security=as_user(pki, "bob"), retry_for=RETRY_FOR)
    keys_a = JobKeys(JOB_A)
    try:
        alice.put(keys_a.commit, "alice's")
        for attempt in (lambda: bob.get(keys_a.commit), lambda: bob.get_prefix(keys_a.prefix),
                        lambda: bob.put(keys_a.commit, "bob's"),
                        lambda: bob.delete_prefix(keys_a.prefix),
                        lambda: bob.get(keys_a.launchers().config)):
            with pytest.raises(EtcdAccessError, match="user 'bob' may not .*job id"):
                attempt()
        assert alice.get(keys_a.commit).value == b"alice's"
        bob.put(JobKeys(JOB_B).commit, "bob's")  # bob's own job is his to write
    finally:
        alice.close()
        bob.close()


def test_a_watch_etcd_refuses_is_named_once_and_the_others_on_its_stream_go_on(
        secure_etcd, pki, caplog):
    """etcd refuses a watch of another job's keys by cancelling it (naming it -1, not by its
    id): the refusal is logged once with the fix, and the user's own watch on the same stream
    hears its keys."""
    bob = EtcdClient(secure_etcd.url, security=as_user(pki, "bob"), retry_for=RETRY_FOR)
    opened, heard = threading.Event(), threading.Event()
    try:
        with caplog.at_level(logging.WARNING, logger="elastic.cluster"):
            cancel_theirs = bob.watch_prefix(JobKeys(JOB_A).prefix, 0, lambda events: None)
            cancel_mine = bob.watch_range(KeyRange.prefix(JobKeys(JOB_B).prefix), 0,
                                          lambda events: heard.set(), opened.set)
            assert opened.wait(WAIT_S), "bob's own watch was not opened"
            bob.put(JobKeys(JOB_B).commit, "bob's")
            assert heard.wait(WAIT_S), "bob's own watch heard nothing"
            refusals = [r.getMessage() for r in caplog.records
                        if r.getMessage().startswith("etcd refused the watch")]
        cancel_theirs()
        cancel_mine()
        assert len(refusals) == 1, refusals
        assert JobKeys(JOB_A).prefix in refusals[0] and "read access" in refusals[0]
    finally:
        bob.close()


def test_an_auth_token_etcd_no_longer_accepts_is_replaced_without_the_caller_noticing(
        secure_etcd, pki):
    client = EtcdClient(secure_etcd.url, security=as_user(pki, "alice"))
    try:
        client.put(f"/elastic/{JOB_A}/token", "before")
        # Turning authentication off and on again invalidates every token etcd handed out.
        secure_etcd.etcdctl("auth", "disable", user=f"root:{ROOT_PASSWORD}")
        secure_etcd.etcdctl("auth", "enable", user=f"root:{ROOT_PASSWORD}")
        client.put(f"/elastic/{JOB_A}/token", "after")
        assert client.get(f"/elastic/{JOB_A}/token").value == b"after"
    finally:
        client.close()


def test_an_etcd_that_requires_a_user_asks_for_one_when_none_is_given(private_etcd):
    etcdctl = str(Path(find_etcd_binary()).with_name("etcdctl"))
    for args in (["user", "add", f"root:{ROOT_PASSWORD}"], ["auth", "enable"]):
        subprocess.run([etcdctl, "--endpoints", private_etcd.url, *args], check=True,
                       capture_output=True, timeout=30)
    client = EtcdClient(private_etcd.url, retry_for=RETRY_FOR)
    try:
        with pytest.raises(EtcdAccessError) as refused:
            client.put(f"/elastic/{JOB_A}/x", "v")
    finally:
        client.close()
    assert "requires authentication; pass --etcd-user and --etcd-password-file" \
        in str(refused.value)


@pytest.mark.unit
def test_tls_files_for_an_http_url_are_refused_rather_than_ignored(tmp_path: Path):
    cacert = tmp_path / "ca.pem"
    cacert.write_text("not used")
    with pytest.raises(ValueError, match="use https://"):
        uses_tls("http://127.0.0.1:2379", EtcdSecurity(cacert=str(cacert)))
    with pytest.raises(ValueError, match="mix"):
        uses_tls("http://127.0.0.1:2379,https://127.0.0.1:2380")
    assert uses_tls("https://127.0.0.1:2379") and not uses_tls("http://127.0.0.1:2379")


@pytest.mark.unit
def test_half_of_a_certificate_pair_or_a_user_without_password_is_named(tmp_path: Path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ValueError, match="--etcd-cert and --etcd-key"):
        EtcdSecurity(cert=str(cert)).validate()
    with pytest.raises(ValueError, match="needs a password"):
        EtcdSecurity(user="alice").validate()
    with pytest.raises(ValueError, match="not a readable file"):
        EtcdSecurity(cacert=str(tmp_path / "missing.pem")).validate()


@pytest.mark.unit
def test_the_password_comes_from_a_file_or_the_environment_and_is_never_shown(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("ELASTIC_ETCD_USER", "alice")
    monkeypatch.setenv("ELASTIC_ETCD_PASSWORD", "from-env")
    assert EtcdSecurity.resolve().password == "from-env"
    secret = tmp_path / "password"
    secret.write_text("from-file\n")
    security = EtcdSecurity.resolve(password_file=str(secret))
    assert security.password == "from-file"
    assert "from-file" not in repr(security) and "from-file" not in " ".join(security.as_flags())
    assert security.as_env()["ELASTIC_ETCD_PASSWORD"] == "from-file"


def test_an_http_url_at_an_etcd_that_speaks_tls_only_asks_for_https(secure_etcd):
    url = secure_etcd.url.replace("https://", "http://")
    client = EtcdClient(url, security=EtcdSecurity(), retry_for=RETRY_FOR)
    try:
        with pytest.raises(EtcdAccessError, match="speaks TLS only: use --etcd https://"):
            client.get(f"/elastic/{JOB_A}/x")
    finally:
        client.close()


def test_without_a_ca_file_the_server_is_verified_against_the_default_roots(secure_etcd, pki,
                                                                           monkeypatch):
    # gRPC's default roots come from this file when it is set (else the system's store).
    monkeypatch.setenv("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH", str(pki.ca))
    security = as_user(pki, "alice", cacert="")
    client = EtcdClient(secure_etcd.url, security=EtcdSecurity(
        cert=security.cert, key=security.key, user="alice", password=PASSWORDS["alice"]))
    try:
        client.put(f"/elastic/{JOB_A}/roots", "v")
        assert client.get(f"/elastic/{JOB_A}/roots").value == b"v"
    finally:
        client.close()
