"""How a connection to etcd is made: URLs, gRPC channel options, TLS, the auth token.

aetcd 1.0 builds only plaintext channels: ``Client`` is aetcd's client on a channel built here,
with TLS for ``https://`` URLs (credentials from ``tls``) and the token of an etcd user,
taken with the Authenticate call when connecting (``EtcdClient`` connects again, for a new
token, when etcd no longer accepts the old one). ``refusal`` turns etcd's refusals (wrong
password, no permission) into ``EtcdAccessError`` sentences with the fix. With
``client``, the only module that knows aetcd; it must not know about jobs.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc

from elastic.foundation.errors import EtcdAccessError
from elastic.foundation.settings import EtcdSecurity
from elastic.foundation.timeouts import Timeouts


class EtcdBusy(aetcd.ConnectionFailedError):
    """etcd turned a request away as "too many requests": its applied writes lag its commits
    by more than it allows. Back-pressure that passes, so it is retried as a lost connection
    is (``busy`` tells it from etcd's other RESOURCE_EXHAUSTED answers, which are limits)."""


# The errors of a connection that may work again: retried, and a watch re-opened.
TRANSIENT = (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, aetcd.InternalError)


def cancelled_by_caller() -> bool:
    """Whether the running task was cancelled from outside (its caller gave up), rather than
    by a gRPC call of its own that was cancelled because another request closed the connection
    under it. Python 3.10 cannot tell: then, from outside."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is None or cancelling() > 0


def grpc_options(timeouts: Timeouts) -> dict[str, int]:
    """gRPC channel options from the table. gRPC's default reconnect backoff waits long after an
    outage (up to minutes); these recover at once, and pings find a dead connection."""
    def ms(value: timedelta) -> int:
        return round(value.total_seconds() * 1000)

    return {
        "grpc.initial_reconnect_backoff_ms": ms(timeouts.reconnect),
        "grpc.min_reconnect_backoff_ms": ms(timeouts.reconnect),
        "grpc.max_reconnect_backoff_ms": ms(timeouts.backoff_max),
        "grpc.keepalive_time_ms": ms(timeouts.etcd_ping),
        "grpc.keepalive_timeout_ms": ms(timeouts.etcd_ping_timeout),
    }


def parse_endpoints(urls: str) -> list[tuple[str, int]]:
    """Parses ``http://host:port[,http://host:port...]`` into (host, port) pairs.

    Raises:
        ValueError: a URL has no host or port.
    """
    return [(host, port) for _, host, port in _parse_urls(urls)]


def _parse_urls(urls: str) -> list[tuple[str, str, int]]:
    endpoints = []
    for url in (u.strip() for u in urls.split(",")):
        if not url:
            continue
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"etcd URL {url!r} must start with http:// or https://.")
        try:
            port = parts.port
        except ValueError:  # urllib's "Port out of range 0-65535" names no URL
            raise ValueError(f"etcd URL {url!r} has a port outside 1-65535, e.g. "
                             "http://127.0.0.1:2379.") from None
        if not parts.hostname or not port:
            raise ValueError(f"etcd URL {url!r} needs a host and a port, e.g. http://127.0.0.1:2379.")
        endpoints.append((parts.scheme, parts.hostname, parts.port))
    if not endpoints:
        raise ValueError("No etcd URL given: pass --etcd http://HOST:PORT or set ELASTIC_ETCD.")
    return endpoints


def uses_tls(urls: str, security: EtcdSecurity | None = None) -> bool:
    """Whether ``urls`` are reached with TLS (``https://``), checked against ``security``.

    Raises:
        ValueError: http:// and https:// URLs mixed, or TLS files given for http:// URLs (they
            would be ignored and the traffic would be plaintext).
    """
    schemes = {scheme for scheme, _, _ in _parse_urls(urls)}
    if len(schemes) > 1:
        raise ValueError(f"etcd URLs {urls!r} mix http:// and https://: use one scheme.")
    tls = schemes == {"https"}
    if not tls and security is not None and security.uses_tls_files:
        raise ValueError(f"--etcd-cacert/--etcd-cert/--etcd-key are given but the etcd URL "
                         f"{urls!r} is http://: use https:// so that they are used.")
    return tls


class Client(aetcd.Client):
    """aetcd's client on a channel built here: TLS when ``credentials`` are given, and an auth
    token when a user is (aetcd's own ``connect`` builds plaintext channels only)."""

    def __init__(self, host: str, port: int, *, credentials: grpc.ChannelCredentials | None,
                 security: EtcdSecurity, timeout: float, options: dict[str, int]) -> None:
        super().__init__(host=host, port=port, timeout=timeout, options=options)
        self._credentials = credentials
        self._security = security

    async def connect(self) -> None:
        """See base class. Raises ``Refused`` when etcd refuses the user."""
        if self._connected.is_set():
            return
        target, options = f"{self._host}:{self._port}", list(self._options.items())
        self.channel = (grpc.aio.insecure_channel(target, options=options)
                        if self._credentials is None
                        else grpc.aio.secure_channel(target, self._credentials, options=options))
        if self._security.user:
            try:
                reply = await aetcd.rpc.AuthStub(self.channel).Authenticate(
                    aetcd.rpc.AuthenticateRequest(name=self._security.user,
                                                  password=self._security.password),
                    timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:
                await self.channel.close()
                self._init_channel_attrs()
                raise _authenticate_error(exc) from exc
            self.metadata = (("token", reply.token),)
        self.kvstub = aetcd.rpc.KVStub(self.channel)
        self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
        self.leasestub = aetcd.rpc.LeaseStub(self.channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel),
                                              timeout=self._timeout, metadata=self.metadata)
        self._connected.set()


class Refused(aetcd.ClientError):
    """etcd refused the user's authentication: ``code`` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


def _authenticate_error(exc: grpc.aio.AioRpcError) -> aetcd.ClientError:
    """Translates a failed Authenticate: unreachable is transient, anything else a refusal."""
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return aetcd.ConnectionFailedError(exc.details())
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return aetcd.ConnectionTimeoutError(exc.details())
    return Refused(exc.code(), exc.details() or "")


def client_error(exc: grpc.aio.AioRpcError) -> aetcd.ClientError:
    """aetcd's error for a gRPC error of a call made outside aetcd's own methods (the same
    mapping, with ``exc`` as the cause that ``status_of`` reads)."""
    try:
        aetcd.exceptions._handle_exception(exc)  # raises the mapped error, never returns
    except aetcd.ClientError as mapped:
        return mapped
    return aetcd.ClientError(str(exc))  # unreachable: _handle_exception always raises


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC status behind an aetcd error (aetcd keeps the gRPC error as the cause)."""
    if isinstance(exc, Refused):
        return exc.code
    cause = exc.__cause__
    return cause.code() if isinstance(cause, grpc.aio.AioRpcError) else None


def busy(exc: aetcd.ClientError) -> EtcdBusy | None:
    """``exc`` as ``EtcdBusy`` when it is etcd's "too many requests" (None: another error)."""
    if status_of(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED and "too many requests" in str(exc):
        return EtcdBusy(str(exc))
    return None


def refusal(exc: aetcd.ClientError, what: str, urls: str,
            security: EtcdSecurity) -> EtcdAccessError | None:
    """The sentence for a refusal that waiting would not end: authentication, permission, or
    a request over one of the server's limits (None: not such a refusal)."""
    code, user = status_of(exc), security.user
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return EtcdAccessError(
            f"etcd user {user or '(client certificate)'!r} may not {what} ({exc}): give its "
            "role readwrite on this job's prefixes (see docs/security.md), or "
            "run with the job id that this user is for.")
    if isinstance(exc, Refused) and code == grpc.StatusCode.INVALID_ARGUMENT:
        return EtcdAccessError(
            f"etcd at {urls} refused user {user!r} ({exc}): check --etcd-user and the "
            "password in --etcd-password-file or ELASTIC_ETCD_PASSWORD.")
    if isinstance(exc, Refused) and code == grpc.StatusCode.FAILED_PRECONDITION:
        return EtcdAccessError(
            f"etcd at {urls} has authentication turned off, yet user {user!r} was "
            "given ({exc}): turn it on (etcdctl auth enable) or leave out --etcd-user.")
    if isinstance(exc, Refused):
        return EtcdAccessError(f"etcd at {urls} refused user {user!r} ({exc}).")
    if code == grpc.StatusCode.INVALID_ARGUMENT and "user name is empty" in str(exc):
        return EtcdAccessError(
            f"etcd at {urls} refused {what} ({exc}): it requires authentication; pass "
            "--etcd-user and --etcd-password-file (ELASTIC_ETCD_USER, ELASTIC_ETCD_PASSWORD).")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "database space exceeded" in str(exc):
        return EtcdAccessError(
            f"etcd at {urls} is out of space ({exc}): its history filled its "
            "--quota-backend-bytes. Compact and defragment it, then clear its alarm "
            "(etcdctl compact REVISION; etcdctl defrag; etcdctl alarm disarm), and run it with "
            "--auto-compaction-retention (docs/multi-node.md).")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return EtcdAccessError(
            f"{urls} answered {what} with 'method not found' ({exc}): it serves gRPC, but is "
            "not an etcd v3 client URL (another service, or etcd's peer port). Check --etcd / "
            "ELASTIC_ETCD.")
    if code == grpc.StatusCode.INVALID_ARGUMENT or (
            code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in str(exc)):
        return EtcdAccessError(
            f"etcd at {urls} refused {what} as invalid ({exc}); if that names one of its "
            "limits, raise it on the etcd server (--max-request-bytes, --max-txn-ops).")
    return None

# -- key-value ----------------------------------------------------------------------------
