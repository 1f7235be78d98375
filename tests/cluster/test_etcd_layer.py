"""The etcd layer against a real server: client, leases and fencing, watches, the torch store."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import aetcd.exceptions
import grpc
import pytest

from elastic.foundation.errors import EtcdAccessError, EtcdUnavailableError
from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.etcd.txn import Carried
from elastic.cluster.etcd.key_range import KeyRange
from elastic.launch.embedded_etcd import EmbeddedEtcd
from elastic.launch.job_config import JobConfig, claim
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.membership import EtcdMembership, new_member_id
from elastic.cluster.rounds.plan import JoinRequest, Plan
from elastic.cluster.rounds.rendezvous import Rendezvous, RendezvousConfig
from elastic.foundation.timeouts import Timeouts
from tests.support.held_link import HeldLink
from tests.support.polling import poll_until

LEASE_30S = Timeouts.from_env({}, lease_ttl=timedelta(seconds=30))


def test_create_is_a_compare_and_swap_that_only_one_caller_wins(client):
    assert client.create("/t/cas/plan", "first", also={"/t/cas/round": "1"})
    assert not client.create("/t/cas/plan", "second", also={"/t/cas/round": "2"})
    assert client.get("/t/cas/plan").value == b"first"
    assert client.get("/t/cas/round").value == b"1"


def test_a_revoked_lease_deletes_its_keys_and_the_watch_sees_it(client):
    _, revision = client.get_prefix("/t/lease/")
    seen: list[WatchEvent] = []
    deleted = threading.Event()

    def on_events(events: list[WatchEvent]) -> None:
        seen.extend(events)
        if any(e.kind == "delete" for e in events):
            deleted.set()

    cancel = client.watch_prefix("/t/lease/", revision + 1, on_events)
    try:
        lease = client.grant(timedelta(seconds=5))
        client.put("/t/lease/k", "v", lease=lease)
        client.revoke(lease)
        assert deleted.wait(timeout=10)
        assert [e.kind for e in seen] == ["put", "delete"]
        assert client.refresh(lease) <= 0
    finally:
        cancel()


def test_a_member_whose_lease_expires_is_fenced(client):
    membership = EtcdMembership(client, JobKeys("fence-test"), "127.0.0.1",
                                Timeouts.from_env({}, lease_ttl=timedelta(seconds=1)))
    fenced = threading.Event()
    membership.on_fenced(fenced.set)
    membership.register()
    try:
        # Revoking from outside is what a frozen member finds when it wakes: the lease is gone.
        client.revoke(membership.lease)
        assert fenced.wait(timeout=10)
        assert membership.fenced.is_set()
    finally:
        membership.leave()


def test_a_graceful_leave_deletes_the_member_key_at_once(client):
    keys = JobKeys("leave-test")
    membership = EtcdMembership(client, keys, "127.0.0.1", LEASE_30S)
    membership.register()
    assert client.get(keys.member(membership.member_id)) is not None
    membership.leave()
    assert client.get(keys.member(membership.member_id)) is None
    assert not membership.fenced.is_set()


def _keepalive_streams_started(url: str) -> float:
    """etcd's own count of LeaseKeepAlive streams opened (from its /metrics)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("grpc_server_started_total{")
               and 'grpc_method="LeaseKeepAlive"' in line)


def test_every_lease_of_a_client_is_renewed_on_one_stream_and_each_gets_its_own_answer(
        private_etcd):
    client = EtcdClient(private_etcd.url)
    try:
        leases = [client.grant(timedelta(seconds=30)) for _ in range(20)]
        gone = leases.pop()
        client.revoke(gone)
        before = _keepalive_streams_started(private_etcd.url)
        with ThreadPoolExecutor(8) as pool:
            ttls = list(pool.map(client.refresh, leases * 5 + [gone] * 5))
        assert all(0 < ttl <= 30 for ttl in ttls[:-5]) and ttls[-5:] == [0] * 5
        assert _keepalive_streams_started(private_etcd.url) - before == 1
    finally:
        client.close()


def test_a_lease_is_renewed_on_a_new_stream_after_etcd_restarts_under_the_old_one(private_etcd):
    client = EtcdClient(private_etcd.url, retry_for=timedelta(seconds=30))
    try:
        lease = client.grant(timedelta(seconds=60))
        assert client.refresh(lease) > 0
        private_etcd.restart()  # the stream breaks; etcd keeps its leases across a restart
        assert client.refresh(lease) > 0
        client.revoke(lease)
        assert client.refresh(lease) == 0
    finally:
        client.close()


class BatchCountingClient(EtcdClient):
    """An ``EtcdClient`` that records each batch of lease renewals it is asked for."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.batches: list[list[int]] = []
        self.renewed = threading.Condition()

    def refresh_many(self, leases, retry_for=None):  # type: ignore[no-untyped-def]
        remaining = super().refresh_many(leases, retry_for)
        with self.renewed:
            self.batches.append(list(leases))
            self.renewed.notify_all()
        return remaining

    def wait_renewed(self, leases: list[int], times: int, timeout_s: float) -> bool:
        """Waits until each of ``leases`` was renewed ``times`` times."""
        def done() -> bool:
            return all(sum(b.count(lease) for b in self.batches) >= times for lease in leases)

        with self.renewed:
            return self.renewed.wait_for(done, timeout=timeout_s)


def test_the_leases_of_a_clients_members_are_renewed_together_from_one_thread(etcd):
    threads_before = set(threading.enumerate())
    client = BatchCountingClient(etcd.url)
    members = [EtcdMembership(client, JobKeys("renewal-batches"), "127.0.0.1",
                              Timeouts.from_env({}, lease_ttl=timedelta(seconds=3),
                                                keepalive=timedelta(seconds=0.5)))
               for _ in range(30)]
    try:
        for member in members:
            member.register()
        leases = [member.lease for member in members]
        assert client.wait_renewed(leases, times=3, timeout_s=30)
        renewing = [t for t in set(threading.enumerate()) - threads_before
                    if t.name == "elastic-keepalive"]
        assert len(renewing) == 1, f"{len(renewing)} threads renew 30 leases"
        renewals = sum(len(batch) for batch in client.batches)
        assert renewals / len(client.batches) >= 5, client.batches
        assert not any(member.fenced.is_set() for member in members)
    finally:
        for member in members:
            member.leave()
        client.close()
    renewing[0].join(timeout=10)
    assert not renewing[0].is_alive(), "the renewal thread outlived every lease of its client"


def test_a_member_whose_id_is_taken_registers_under_another_and_leaves_the_first_as_it_was(
        client):
    keys = JobKeys("id-collision-test")
    first = EtcdMembership(client, keys, "127.0.0.1", LEASE_30S)
    second = EtcdMembership(client, keys, "127.0.0.1", LEASE_30S)
    second.member_id = first.member_id  # what two equal random ids in one process would give
    first.register()
    try:
        second.register()
        try:
            assert client.get(keys.member(first.member_id)).lease == first.lease
            assert second.member_id != first.member_id
            assert client.get(keys.member(second.member_id)).lease == second.lease
            assert first.confirm_lease() and not first.fenced.is_set()
        finally:
            second.leave()
        assert client.get(keys.member(first.member_id)).lease == first.lease
    finally:
        first.leave()


def test_a_registration_sent_again_finds_its_own_write_and_another_finds_the_key_taken(client):
    lease, other = client.grant(timedelta(seconds=30)), client.grant(timedelta(seconds=30))
    try:
        args = ("/t/reg/members/a", "info", lease, ("/t/reg/control/lead", "a"), "/t/reg/control/")
        first = client.put_and_claim(*args)
        again = client.put_and_claim(*args)  # what a retry after a lost reply sends
        assert (first.taken, first.claimed) == (again.taken, again.claimed) == (False, True)
        assert again.revision == first.revision
        taken = client.put_and_claim("/t/reg/members/a", "info", other, None, "/t/reg/control/")
        assert taken.taken and not taken.claimed
        assert client.get("/t/reg/members/a").lease == lease
    finally:
        client.revoke(lease)
        client.revoke(other)


def test_a_registration_carries_its_key_only_while_the_guard_key_is_absent(client):
    lease = client.grant(timedelta(seconds=30))
    try:
        carry = Carried("/t/carry/rounds/1/join/a", "asks", "/t/carry/round")
        first = client.put_and_claim("/t/carry/members/a", "info", lease, None, "/t/carry/c/",
                                     carry)
        assert first.carried
        written = client.get(carry.key)
        assert written is not None and written.value == b"asks" and written.lease == lease
        assert written.mod_revision == first.revision  # one write, one revision
        again = client.put_and_claim("/t/carry/members/a", "info", lease, None, "/t/carry/c/",
                                     carry)
        assert not again.taken and not again.carried  # a retry does not claim the write
        client.put("/t/carry/round", "1")
        guarded = client.put_and_claim("/t/carry/members/b", "info", lease, None,
                                       "/t/carry/c/", Carried("/t/carry/rounds/1/join/b", "asks",
                                                              "/t/carry/round"))
        assert not guarded.carried and client.get("/t/carry/rounds/1/join/b") is None
        assert client.get("/t/carry/members/b") is not None
    finally:
        client.revoke(lease)
        client.delete_prefix("/t/carry/")


def test_a_registration_writes_the_key_beside_it_empty_and_still_tells_its_claim_and_carry(
        client):
    lease = client.grant(timedelta(seconds=30))
    try:
        carry = Carried("/t/beside/rounds/1/join/a", "asks", "/t/beside/round")
        claim = ("/t/beside/c/lead", "a")
        first = client.put_and_claim("/t/beside/members/a", "info", lease, claim, "/t/beside/c/",
                                     carry, beside="/t/beside/assigned/a")
        assert (first.taken, first.claimed, first.carried) == (False, True, True)
        seat = client.get("/t/beside/assigned/a")
        assert seat is not None and seat.value == b"" and seat.lease == lease
        assert seat.mod_revision == first.revision
        client.put("/t/beside/round", "1")  # the second registration carries nothing
        second = client.put_and_claim(
            "/t/beside/members/b", "info", lease, ("/t/beside/c/lead", "b"), "/t/beside/c/",
            Carried("/t/beside/rounds/1/join/b", "asks", "/t/beside/round"),
            beside="/t/beside/assigned/b")
        assert (second.taken, second.claimed, second.carried) == (False, False, False)
        assert client.get("/t/beside/assigned/b").value == b""
    finally:
        client.revoke(lease)
        client.delete_prefix("/t/beside/")


def test_member_ids_made_in_one_process_do_not_repeat():
    made = {new_member_id() for _ in range(100_000)}
    assert len(made) == 100_000


@pytest.mark.parametrize("lose_data", [False, True], ids=["on its data", "without its data"])
def test_a_watch_sees_every_key_across_an_etcd_restart(private_etcd, lose_data):
    """Each write is seen once. The put after the restart may be applied twice: its first
    answer can time out on the fresh etcd (a loaded machine, a fresh etcd's first write) and
    the client asks again, a second write that the watch rightly brings. So the check is on
    (key, revision): no revision twice, and the keys in the order written."""
    client = EtcdClient(private_etcd.url, retry_for=timedelta(seconds=30))
    try:
        for i in range(20):  # a fresh etcd's revision then starts well below the old one's
            client.put(f"/t/old/{i}", "x")
        _, revision = client.get_prefix("/t/restart/")
        seen: list[tuple[str, int]] = []
        got: list[str] = []
        arrived = threading.Condition()

        def on_events(events: list[WatchEvent]) -> None:
            with arrived:
                seen.extend((e.key, e.revision) for e in events)
                got.extend(e.key for e in events)
                arrived.notify_all()

        cancel = client.watch_prefix("/t/restart/", revision + 1, on_events)
        client.put("/t/restart/before", "1")
        with arrived:  # the watch is open on the old etcd
            assert arrived.wait_for(lambda: got, timeout=30), got
        private_etcd.restart(lose_data=lose_data)
        client.put("/t/restart/after", "2")
        with arrived:
            assert arrived.wait_for(lambda: len(got) >= 2, timeout=30), got
            assert len(set(seen)) == len(seen), f"a revision was brought twice: {seen}"
            assert list(dict.fromkeys(got)) == ["/t/restart/before", "/t/restart/after"], seen
        cancel()
    finally:
        client.close()


def test_a_watch_from_etcds_current_revision_misses_nothing_when_it_breaks_before_its_first_event(
        private_etcd):
    """A watch asked from revision 0 (etcd's next) re-opens from the revision etcd began it at,
    not from 0 again: a key written before it re-opened is still brought."""
    client = EtcdClient(private_etcd.url, retry_for=timedelta(seconds=30))
    writer = EtcdClient(private_etcd.url, retry_for=timedelta(seconds=30))
    try:
        got: list[str] = []
        arrived = threading.Condition()
        opened = threading.Event()

        def on_events(events: list[WatchEvent]) -> None:
            with arrived:
                got.extend(e.key for e in events)
                arrived.notify_all()

        cancel = client.watch_range(KeyRange.prefix("/t/zero/"), 0, on_events, opened.set)
        assert opened.wait(30)
        opened.clear()
        private_etcd.restart()  # on its data; the watch re-opens after its backoff
        writer.put("/t/zero/while-it-re-opened", "1")
        assert opened.wait(30)
        with arrived:
            assert arrived.wait_for(lambda: got, timeout=10), "the key written was missed"
        assert got == ["/t/zero/while-it-re-opened"]
        cancel()
    finally:
        client.close()
        writer.close()


def test_watches_created_while_etcd_is_frozen_each_get_their_own_events(private_etcd):
    """A create that gave up while etcd was frozen must not feed its events to a later watch
    (aetcd hands a create's answer to whichever create waits when it arrives; ours name their
    watch ids)."""
    client = EtcdClient(private_etcd.url, retry_for=timedelta(seconds=30))
    heard = _Heard(["/t/b/", "/t/c/"])
    try:
        _, revision = client.get_prefix("/t/")  # connected before etcd freezes
        # b's and c's creates go out together; b's gives up first and drops the connection
        cancels = _while_frozen_a_create_gives_up(private_etcd, "/t/b/", lambda: [
            client.watch_prefix(p, revision + 1, heard.listener(p)) for p in heard.got])
        _each_hears_its_own(client, heard, cancels)
    finally:
        client.close()


def test_requests_that_fail_together_on_a_frozen_endpoint_move_to_the_next_one_once(private_etcd):
    """Each request that failed used to move the client on by one endpoint: four gets and three
    watches on a frozen one of two moved it seven times (an even count lands back on it)."""
    other = EmbeddedEtcd().start()
    try:
        _fail_over_once_from_a_frozen_endpoint(private_etcd, other)
    finally:
        other.stop()


def _fail_over_once_from_a_frozen_endpoint(frozen: EmbeddedEtcd, other: EmbeddedEtcd) -> None:
    client = EtcdClient(f"{frozen.url},{other.url}", retry_for=timedelta(seconds=60))
    try:
        client.get("/t/any")  # connected to the first
        opened = [threading.Event() for _ in range(3)]
        cancels = [client.watch_range(KeyRange.prefix(f"/t/frozen/{i}/"), 0, lambda events: None,
                                      made.set) for i, made in enumerate(opened)]
        assert all(made.wait(20) for made in opened)
        frozen.pause()
        try:
            with ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda i: client.get(f"/t/after/{i}"), range(4),
                                    timeout=60))
        finally:
            frozen.resume()
        assert got == [None] * 4
        assert client._endpoint_index == 1, client._endpoint_index
        for cancel in cancels:
            cancel()
    finally:
        client.close()


def _while_frozen_a_create_gives_up(etcd, prefix: str, open_watches):  # noqa: ANN001, ANN202
    """Freezes ``etcd``, opens watches (``open_watches``, which returns their cancels) and
    thaws it once the watch on ``prefix`` broke, as its log says: its create gave up, or another
    create on its connection did."""
    gave_up = _LogSeen(f"watch on {prefix}* broke")
    watch_log = logging.getLogger("elastic.cluster")
    level = watch_log.level
    watch_log.setLevel(logging.DEBUG)
    watch_log.addHandler(gave_up)
    etcd.pause()
    try:
        cancels = open_watches()
        assert gave_up.wait(30), f"the create of the watch on {prefix} never gave up"
        return cancels
    finally:
        etcd.resume()
        watch_log.removeHandler(gave_up)
        watch_log.setLevel(level)


def _each_hears_its_own(client: EtcdClient, heard: "_Heard", cancels) -> None:  # noqa: ANN001
    """Writes a key under each prefix ``heard`` follows: each watch hears its own, and only it."""
    for prefix in heard.got:
        client.put(f"{prefix}x", "1")
    heard.wait_for_all(20)
    assert heard.got == {p: [f"{p}x"] for p in heard.got}
    for cancel in cancels:
        cancel()


class _LogSeen(logging.Handler):
    """Turns set once a log record containing ``text`` is emitted (any thread)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self._seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self._seen.set()

    def wait(self, timeout_s: float) -> bool:
        return self._seen.wait(timeout_s)


def test_an_unreachable_etcd_raises_after_the_retry_deadline_naming_the_url():
    from elastic.cluster.links.ports import free_port
    url = f"http://127.0.0.1:{free_port()}"
    client = EtcdClient(url, retry_for=timedelta(seconds=2))
    started = time.monotonic()
    try:
        with pytest.raises(EtcdUnavailableError, match=url.replace(".", r"\.")):
            client.put("/x", "y")
        # A hang guard, not a claim: a retry without its deadline would never raise.
        assert time.monotonic() - started < 15
    finally:
        client.close()


# The attempts cancelled while the loop was busy never start: asyncio says so, as intended.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_a_client_thread_that_never_replies_is_an_etcd_error_naming_the_url_not_a_timeout(etcd):
    S = timedelta(seconds=1)
    timeouts = dataclasses.replace(Timeouts(), etcd_rpc=0.2 * S, etcd_retry=S, shutdown=0.1 * S)
    client = EtcdClient(etcd.url, timeouts=timeouts)
    stuck, free = threading.Event(), threading.Event()

    async def block_the_loop() -> None:
        stuck.set()
        free.wait(10)  # the client's own thread, busy: no reply comes back from it

    try:
        asyncio.run_coroutine_threadsafe(block_the_loop(), client._loop)
        assert stuck.wait(5)
        with pytest.raises(EtcdUnavailableError, match=etcd.url.replace(".", r"\.")):
            client.get("/x")
    finally:
        free.set()
        client.close()


def _answered_busy(times: int, key: bytes):
    """An operation that etcd answers "too many requests" ``times`` times, then a put of
    ``key``. etcd says so (RESOURCE_EXHAUSTED) while its applied writes lag its commits by more
    than it allows, a backlog no test here can build: the answer is raised as aetcd raises
    etcd's, from the gRPC error it came as."""
    left = [times]

    async def op(c):  # noqa: ANN001, ANN202 (aetcd's client)
        if left[0]:
            left[0] -= 1
            aetcd.exceptions._handle_exception(grpc.aio.AioRpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, details="etcdserver: too many requests"))
        return await c.put(key, b"v")

    return op, left


def test_an_etcd_too_busy_for_a_request_is_asked_again_until_it_takes_it(etcd):
    client = EtcdClient(etcd.url)
    try:
        op, left = _answered_busy(2, b"/busy/taken")
        client._call(op, "put /busy/taken")
        assert left == [0] and client.get("/busy/taken").value == b"v"
    finally:
        client.close()


def test_an_etcd_that_stays_too_busy_is_named_in_one_line_with_what_to_do(etcd):
    client = EtcdClient(etcd.url, retry_for=timedelta(seconds=1))
    try:
        op, _ = _answered_busy(10**6, b"/busy/never")
        with pytest.raises(EtcdUnavailableError, match="too busy") as raised:
            client._call(op, "put /busy/never")
        assert etcd.url in str(raised.value) and "\n" not in str(raised.value)
        assert client.get("/busy/never") is None
    finally:
        client.close()


def test_etcd_urls_without_a_port_are_rejected_with_an_example():
    with pytest.raises(ValueError, match="host and a port"):
        EtcdClient("http://127.0.0.1")


_FORKING_LOADER = """
import sys
from elastic.cluster.etcd.client import EtcdClient
from torch.utils.data import DataLoader

client = EtcdClient(sys.argv[1])
client.put("fork-check", "x")
assert sum(len(b) for b in DataLoader(list(range(64)), batch_size=8, num_workers=2)) == 64
client.close()
print("loaded")
"""


def test_dataloader_workers_forking_beside_the_client_make_grpc_log_nothing(etcd, tmp_path):
    script = tmp_path / "forking_loader.py"
    script.write_text(_FORKING_LOADER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, str(script), etcd.url], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "loaded" in done.stdout
    assert "skipping fork() handlers" not in done.stderr, done.stderr


def test_replace_clearing_prefixes_writes_and_clears_in_one_guarded_transaction(client):
    prefixes = ("/t/clr/job/", "/t/clr/job.launchers/")
    for key, value in {"/t/clr/job/config": "old", "/t/clr/job/rounds/1": "done",
                       "/t/clr/job.launchers/a": "l", "/t/clr/jobx/keep": "k"}.items():
        client.put(key, value)
    old = client.get("/t/clr/job/config")
    assert client.replace("/t/clr/job/config", "new", old.mod_revision, clearing=prefixes).revision
    assert client.get("/t/clr/job/config").value == b"new"
    assert client.get("/t/clr/job/rounds/1") is None and client.get("/t/clr/job.launchers/a") is None
    assert client.get("/t/clr/jobx/keep").value == b"k"
    client.put("/t/clr/job/rounds/2", "fresh")
    # A caller that read the old revision neither clears nor writes.
    refused = client.replace("/t/clr/job/config", "other", old.mod_revision, clearing=prefixes)
    assert refused.revision == 0 and refused.found.value == b"new"
    assert client.get("/t/clr/job/rounds/2").value == b"fresh"
    assert client.get("/t/clr/job/config").value == b"new"


def test_keep_only_deletes_the_rest_of_a_prefix_and_binds_the_kept_keys_to_the_lease(client):
    for key in ("/t/keep/job/a", "/t/keep/job/control/news", "/t/keep/job/m/1",
                "/t/keep/job/round", "/t/keep/job/z", "/t/keep/job.launchers/a"):
        client.put(key, key.rsplit("/", 1)[1])
    kept = [client.get("/t/keep/job/control/news"), client.get("/t/keep/job/round")]
    lease = client.grant(timedelta(seconds=30))
    assert client.keep_only("/t/keep/job/", kept, lease)
    left, _ = client.get_prefix("/t/keep/")
    assert [(kv.key, kv.value, kv.lease) for kv in left] == [
        ("/t/keep/job.launchers/a", b"a", 0), ("/t/keep/job/control/news", b"news", lease),
        ("/t/keep/job/round", b"round", lease)]
    assert client.keep_only("/t/keep/job/", kept, lease), "a retry finds its own writes"
    client.put("/t/keep/job/round", "2")  # changed since it was read: nothing is done
    client.put("/t/keep/job/b", "b")
    other = client.grant(timedelta(seconds=30))
    assert not client.keep_only("/t/keep/job/", [client.get("/t/keep/job/control/news"),
                                                 kept[1]], other)
    assert client.get("/t/keep/job/b").value == b"b"
    assert client.get("/t/keep/job/control/news").lease == lease


def test_many_puts_fit_an_etcd_that_takes_fewer_operations_per_transaction_and_say_so_once(
        small_txn_etcd, caplog):
    client = EtcdClient(small_txn_etcd.url)
    try:
        live, gone = client.grant(timedelta(seconds=30)), client.grant(timedelta(seconds=30))
        assert client.revoke(gone)
        entries = [(f"/few/{i:03d}", f"v{i}", gone if i == 7 else live) for i in range(60)]
        with caplog.at_level(logging.INFO, logger="elastic.cluster.etcd.batches"):
            assert client.put_many(entries) == ["/few/007"]
            assert client.put_many(entries[8:]) == []  # the size that fits is kept
        written, _ = client.get_prefix("/few/")
        assert [kv.key for kv in written] == [k for k, _, _ in entries if k != "/few/007"]
        said = [r.getMessage() for r in caplog.records if "--max-txn-ops" in r.getMessage()]
        assert len(said) == 1, said
    finally:
        client.close()


@pytest.mark.parametrize("mib", [1.8, 3])  # over etcd's own check (1.5 MiB), and over gRPC's
def test_a_request_over_etcds_size_limit_names_that_limit_not_a_missing_user(client, mib):
    with pytest.raises(EtcdAccessError) as refused:
        client.put("/test/too-large", b"x" * int(mib * (1 << 20)))
    message = str(refused.value)
    assert "--max-request-bytes" in message and "--etcd-user" not in message, message


def test_an_etcd_out_of_space_is_named_in_one_line_with_how_to_free_it(full_etcd):
    message = full_etcd.fill()  # 20 MB of history into a 2 MiB quota
    assert "\n" not in message and "--quota-backend-bytes" in message, message
    assert "etcdctl alarm disarm" in message and "--auto-compaction-retention" in message


def test_many_puts_go_in_transactions_and_only_a_key_whose_lease_is_gone_is_not_written(
        client):
    prefix = f"/test/put-many-{os.getpid()}/"
    live, gone = client.grant(timedelta(seconds=30)), client.grant(timedelta(seconds=30))
    assert client.revoke(gone)
    entries = [(f"{prefix}{i:03d}", f"v{i}", gone if i == 150 else live) for i in range(250)]
    try:
        assert client.put_many(entries) == [f"{prefix}150"]
        written, _ = client.get_prefix(prefix)
        assert [kv.key for kv in written] == [k for k, _, _ in entries if not k.endswith("150")]
        assert {kv.lease for kv in written} == {live}
        assert client.put_many([]) == []
    finally:
        client.revoke(live)


def test_replace_while_held_writes_only_while_the_held_key_is_unchanged(client):
    """A coordinator's news write is guarded by its own coordinator key: once that key went
    (its lease ended) or was taken again, the write does nothing."""
    lease = client.grant(timedelta(seconds=30))
    client.put("/t/held/coordinator", "a", lease=lease)
    held = client.get("/t/held/coordinator")
    written = client.replace("/t/held/news", "1", 0, held=(held.key, held.mod_revision))
    news = client.get("/t/held/news")
    # What the next replace compares against.
    assert written.revision == news.mod_revision > held.mod_revision
    client.revoke(lease)  # the leader's lease ends: its key goes
    refused = client.replace("/t/held/news", "2", news.mod_revision,
                             held=(held.key, held.mod_revision))
    assert (refused.revision, refused.found, refused.guard) == (0, news, None)
    client.put("/t/held/coordinator", "b")  # a successor holds it now
    refused = client.replace("/t/held/news", "2", news.mod_revision,
                             held=(held.key, held.mod_revision))
    assert refused.revision == 0 and refused.guard.value == b"b"
    assert client.get("/t/held/news").value == b"1"


class _LetsAnotherLauncherInAfterItsFirstRead:
    """An EtcdClient whose first ``get`` is followed by another launcher's whole claim."""

    def __init__(self, client: EtcdClient, other) -> None:
        self._client, self._other = client, other

    def __getattr__(self, name):
        return getattr(self._client, name)

    def get(self, key):
        value = self._client.get(key)
        if self._other is not None:
            other, self._other = self._other, None
            other()
        return value


def test_of_two_launchers_starting_a_dead_job_together_only_one_starts_it(client):
    keys = JobKeys(f"together-{os.getpid()}")
    client.put(keys.config, "{}")  # a previous run's leftovers, nobody alive
    client.put(keys.rounds + "1/done", "1")
    config = JobConfig(mode="elastic", target="train.py", min_workers=1, max_workers=None,
                       checkpoint=None, backend="auto")
    started_first = []
    second = _LetsAnotherLauncherInAfterItsFirstRead(
        client, lambda: started_first.append(claim(client, keys, config)))
    assert claim(second, keys, config) is False
    assert started_first == [True]
    assert JobConfig.from_json(client.get(keys.config).value) == config
    assert client.get(keys.rounds + "1/done") is None


def _server_threads(server) -> tuple[set[int], str]:
    """The nice values of the server's threads, and its GOMAXPROCS."""
    pid = server.process.pid
    nices = {os.getpriority(os.PRIO_PROCESS, int(t.name))
             for t in Path(f"/proc/{pid}/task").iterdir()}
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    go = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"GOMAXPROCS=")]
    return nices, go[0] if go else ""


@pytest.mark.skipif("GOMAXPROCS" in os.environ, reason="a GOMAXPROCS set by the user wins")
def test_the_embedded_etcd_runs_every_thread_below_training_on_one_go_thread():
    from elastic.launch.embedded_etcd import EmbeddedEtcd
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    with EmbeddedEtcd() as server:
        nices, go_max_procs = _server_threads(server)
        client = EtcdClient(server.url)
        try:
            assert client.put("/still/serves", "yes") > 0
        finally:
            client.close()
    assert nices == {min(ours + 10, 19)} and go_max_procs == "1"
    with EmbeddedEtcd(niceness=0, go_max_procs=None) as server:
        assert _server_threads(server) == ({ours}, "")


def test_embedded_etcd_options_out_of_range_are_refused_with_the_range():
    from elastic.launch.embedded_etcd import EmbeddedEtcd
    with pytest.raises(ValueError, match=r"niceness \(20\) must be within 0\.\.19"):
        EmbeddedEtcd(niceness=20)
    with pytest.raises(ValueError, match=r"go_max_procs \(0\) must be >= 1"):
        EmbeddedEtcd(go_max_procs=0)


def _killed_embedded_etcd(tmp_path: Path, monkeypatch, restart: bool) -> None:  # noqa: ANN001
    """Starts an embedded etcd whose directory is under ``tmp_path``, SIGKILLs it, restarts it
    if ``restart``, and stops it."""
    import elastic.launch.embedded_etcd as embedded
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    server = embedded.EmbeddedEtcd().start()
    try:
        assert server.process is not None
        server.process.kill()
        server.process.wait(timeout=10)
        if restart:
            server.restart()
    finally:
        server.stop()


def test_an_embedded_etcd_killed_then_restarted_removes_its_directory_when_stopped(
        tmp_path, monkeypatch):
    _killed_embedded_etcd(tmp_path, monkeypatch, restart=True)
    assert not list(tmp_path.glob("elastic-etcd-*"))


def test_an_embedded_etcd_that_exits_by_itself_keeps_its_log_when_stopped(tmp_path, monkeypatch):
    _killed_embedded_etcd(tmp_path, monkeypatch, restart=False)
    assert [p.name for p in tmp_path.glob("elastic-etcd-*/etcd.log")] == ["etcd.log"]


def test_a_watch_outlives_a_listener_that_raises_and_keys_that_are_not_utf8(client):
    _, revision = client.get_prefix("/t/hostile/")
    seen: list[str] = []
    last = threading.Event()

    def on_events(events: list[WatchEvent]) -> None:
        for event in events:
            seen.append(event.key)
            if event.key.endswith("boom"):
                raise ValueError("a listener's own bug")
            if event.key.endswith("last"):
                last.set()

    cancel = client.watch_prefix("/t/hostile/", revision + 1, on_events)
    try:
        client.put("/t/hostile/boom", "1")
        client.put(b"/t/hostile/\xff\xfe", "2")
        client.put("/t/hostile/last", "3")
        assert last.wait(timeout=10)
        assert seen == ["/t/hostile/boom", "/t/hostile/last"]
        assert [kv.key for kv in client.get_prefix("/t/hostile/")[0]] == [
            "/t/hostile/boom", "/t/hostile/last"]
    finally:
        cancel()


def test_create_with_an_unchanged_guard_fails_once_the_guarded_key_moved(client):
    client.put("/t/guard/round", "1")
    seen = client.get("/t/guard/round").mod_revision
    assert client.create("/t/guard/plan-2", "p2", also={"/t/guard/round": "2"},
                         unchanged=("/t/guard/round", seen))
    assert not client.create("/t/guard/plan-3", "p3", also={"/t/guard/round": "3"},
                             unchanged=("/t/guard/round", seen))  # round moved: 1 -> 2
    assert client.get("/t/guard/plan-3") is None
    assert client.get("/t/guard/round").value == b"2"


def test_a_member_delayed_past_later_rounds_never_moves_the_round_back(client):
    keys = JobKeys("delayed-member")
    membership = EtcdMembership(client, keys, "127.0.0.1", LEASE_30S)
    membership.register()
    try:
        rendezvous = Rendezvous(client, membership,
                                RendezvousConfig(min_workers=1, max_workers=None,
                                                 timeouts=Timeouts()))
        _, stale_revision = rendezvous._read_round_key()  # it reads round 0, then freezes
        for n in (1, 2, 3):  # meanwhile the others form three rounds and clean up round 1
            assert client.create(keys.plan(n), Plan(n, ["other"]).to_json(),
                                 also={keys.round: str(n)})
        client.delete_prefix(keys.round_prefix(1))
        request = JoinRequest(membership.member_id, 0, "start", "127.0.0.1", 1)
        assert not rendezvous.close(1, stale_revision, [request], None)
        assert rendezvous.latest_round() == 3
        assert rendezvous.read_plan(1) is None
    finally:
        membership.leave()


def test_the_launcher_and_the_key_builder_import_no_grpc_before_the_etcd_client_sets_it_up():
    """gRPC reads its environment (log verbosity, fork support) when first imported; the etcd
    client sets it first. A module imported before the client that pulls gRPC in lets gRPC's
    own log lines through to the user (a TLS refusal printed twice)."""
    probe = ("import sys\n"
             "import elastic.launch.cli, elastic.cluster.rounds.keys, elastic.cluster.rounds.plan\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'aetcd')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]", out


def _watchers(etcd: EmbeddedEtcd) -> int:
    """How many watches etcd holds now, by its own gauge."""
    with urllib.request.urlopen(f"{etcd.url}/metrics", timeout=10) as answer:
        lines = answer.read().decode().splitlines()
    return int(float(next(line.split()[1] for line in lines
                          if line.startswith("etcd_debugging_mvcc_watcher_total "))))


def test_watches_opened_together_do_not_wait_for_each_others_answers(etcd):
    """A process that opens many watches at once (hundreds of members registering, and the
    coordinator's watch among them) sends their creates together, each naming its own watch:
    through a link that holds etcd's every answer, etcd makes all twenty watches before the
    client heard of any, where one create per round trip (aetcd's) lets it make one. Each still
    hears only its own keys."""
    count = 20
    host, port = etcd.url.rsplit("//", 1)[1].rsplit(":", 1)
    with HeldLink((host, int(port))) as link:
        client = EtcdClient(f"http://127.0.0.1:{link.port}")
        try:
            _, revision = client.get_prefix("/t/together/")  # connected
            before = _watchers(etcd)
            opened = threading.Semaphore(0)
            heard = _Heard([f"/t/together/{i}/" for i in range(count)])
            link.hold()
            cancels = [client.watch_range(KeyRange.prefix(p), revision + 1, heard.listener(p),
                                          opened.release) for p in heard.got]
            made = [0]

            def all_made() -> bool:
                made.append(_watchers(etcd) - before)
                return made[-1] >= count

            together = poll_until(all_made, 20)
            link.let_go()
            assert together, (f"etcd held at most {max(made)} of the {count} watches while none "
                              "of its answers had reached the client")
            assert all(opened.acquire(timeout=20) for _ in range(count))
            client.put_many([(f"{p}k", "v", 0) for p in heard.got])
            heard.wait_for_all(20)
            assert heard.got == {p: [f"{p}k"] for p in heard.got}
            for cancel in cancels:
                cancel()
        finally:
            client.close()


def test_an_open_watch_costs_the_clients_loop_one_task_and_a_cancel_ends_it(etcd):
    """A thousand members' watches in one process are three thousand: each used to keep three
    more tasks waiting to cancel it. A cancel whose watch did not end would wait out the
    client's shutdown time, then force it: here that is an hour, so such a cancel hangs the test
    until pytest-timeout ends it."""
    count = 50
    client = EtcdClient(etcd.url, timeouts=Timeouts(shutdown=timedelta(hours=1)))
    try:
        _open_and_cancel_watches(client, count)
    finally:
        client.close()


def _open_and_cancel_watches(client: EtcdClient, count: int) -> None:
    """Opens ``count`` watches, cancels them, and checks the loop's tasks before and after."""
    _, revision = client.get_prefix("/t/tasks/")
    before = _task_count(client)
    opened = threading.Semaphore(0)
    cancels = [client.watch_range(KeyRange.prefix(f"/t/tasks/{i}/"), revision + 1,
                                  lambda events: None, opened.release) for i in range(count)]
    assert all(opened.acquire(timeout=20) for _ in range(count))
    during = _task_count(client)
    for cancel in cancels:
        cancel()
    after = _task_count(client)
    # One each, and the shared stream's own few (its reader, gRPC's writer).
    assert during - before <= count + 5, (before, during)
    assert during - after >= count, (during, after)  # every watch's task ended


def _task_count(client: EtcdClient) -> int:
    """How many tasks the client's loop holds now."""
    async def count() -> int:
        return len(asyncio.all_tasks())

    return asyncio.run_coroutine_threadsafe(count(), client._loop).result(10)


def test_an_open_watch_moves_to_the_next_connection_when_another_watchs_create_gives_up(
        private_etcd):
    client = EtcdClient(private_etcd.url, retry_for=timedelta(seconds=30))
    heard = _Heard(["/t/open/", "/t/late/"])
    try:
        opened = threading.Event()
        _, revision = client.get_prefix("/t/")
        cancels = [client.watch_range(KeyRange.prefix("/t/open/"), revision + 1,
                                      heard.listener("/t/open/"), opened.set)]
        assert opened.wait(20)
        # The late watch's create gives up, and drops the connection under the open watch.
        cancels += _while_frozen_a_create_gives_up(private_etcd, "/t/late/", lambda: [
            client.watch_prefix("/t/late/", revision + 1, heard.listener("/t/late/"))])
        _each_hears_its_own(client, heard, cancels)
    finally:
        client.close()


class _Heard:
    """The keys each of several watches heard, by the prefix it watches."""

    def __init__(self, prefixes: list[str]) -> None:
        self.got: dict[str, list[str]] = {p: [] for p in prefixes}
        self._arrived = threading.Condition()

    def listener(self, prefix: str):  # noqa: ANN201
        def on_events(events: list[WatchEvent]) -> None:
            with self._arrived:
                self.got[prefix].extend(e.key for e in events)
                self._arrived.notify_all()
        return on_events

    def wait_for_all(self, timeout_s: float) -> None:
        with self._arrived:
            assert self._arrived.wait_for(lambda: all(self.got.values()), timeout_s), self.got
