"""TLS to etcd: the gRPC channel credentials, and why a TLS connection failed.

gRPC reports every failed handshake as "unavailable", the same as a server that is down, with
the reason only in its text. So when a TLS connection fails, ``tls_problem`` makes one
handshake of its own with Python's ``ssl`` (the same CA, certificate and key), whose errors are
typed: a certificate problem is permanent and named with its fix; a refused or timed-out
connection is left to the caller's retries. It must not know about jobs, and never logs or
returns a password.
"""

from __future__ import annotations

import datetime
import socket
import ssl
from pathlib import Path

import grpc

from elastic.foundation.settings import EtcdSecurity

# ssl's verify codes (X509_V_ERR_*) that have a fix of their own.
_CERT_EXPIRED = 10
_HOSTNAME_MISMATCH = 62


def channel_credentials(security: EtcdSecurity) -> grpc.ChannelCredentials:
    """gRPC credentials from the CA, certificate and key files (system roots without a CA).

    Raises:
        ValueError: a file cannot be read.
    """
    def read(path: str | None) -> bytes | None:
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read {path} ({exc.strerror or exc}); check "
                             "--etcd-cacert/--etcd-cert/--etcd-key.") from None

    return grpc.ssl_channel_credentials(root_certificates=read(security.cacert),
                                        private_key=read(security.key),
                                        certificate_chain=read(security.cert))


def ssl_context(security: EtcdSecurity) -> ssl.SSLContext:
    """The same trust and identity as ``channel_credentials``, for Python's ``ssl``."""
    context = ssl.create_default_context(cafile=security.cacert)
    if security.cert and security.key:
        context.load_cert_chain(security.cert, security.key)
    return context


def tls_problem(host: str, port: int, security: EtcdSecurity, timeout_s: float) -> str | None:
    """Connects to ``host:port`` with TLS and says what is wrong with the certificates.

    Returns:
        One sentence naming the problem and its fix, or None when the handshake succeeds or
        the server could not be reached at all (down, refused, timed out: worth a retry).
    """
    where = f"etcd at https://{host}:{port}"
    try:
        context = ssl_context(security)
    except (ssl.SSLError, OSError) as exc:
        return (f"The TLS files for {where} cannot be used ({exc}): --etcd-cacert must be a "
                "PEM CA bundle, and --etcd-cert/--etcd-key a matching certificate and key.")
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=host) as tls:
            # TLS 1.3: the server checks the client's certificate after the client's handshake
            # ends, so its verdict arrives with the first reply.
            tls.sendall(b"GET /health HTTP/1.1\r\nHost: etcd\r\nConnection: close\r\n\r\n")
            tls.recv(1)
    except ssl.SSLCertVerificationError as exc:
        return _server_certificate_problem(where, security, exc)
    except ssl.SSLError as exc:
        return _client_certificate_problem(where, security, exc)
    except OSError:
        return None  # refused, reset or timed out: not a certificate problem
    return None


def plaintext_problem(host: str, port: int, timeout_s: float) -> str | None:
    """After a plaintext connection failed: whether ``host:port`` speaks TLS instead.

    Returns:
        One sentence naming the fix (an https:// URL), or None when the server does not
        complete a TLS handshake either (down, refused, or plaintext after all).
    """
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only asks whether it speaks TLS; nothing is sent
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=host):
            pass
    except ssl.SSLError as exc:
        if "ALERT" not in (exc.reason or ""):  # a TLS alert (e.g. "certificate required")
            return None                        # is an answer in TLS; anything else is not
    except OSError:
        return None
    return (f"etcd at http://{host}:{port} speaks TLS only: use --etcd https://{host}:{port} "
            "(with --etcd-cacert naming its CA, unless the system's CAs sign it).")


def _server_certificate_problem(where: str, security: EtcdSecurity,
                                exc: ssl.SSLCertVerificationError) -> str:
    trusted = (f"the CA in --etcd-cacert ({security.cacert})" if security.cacert
               else "the system's CA store (no --etcd-cacert given)")
    if exc.verify_code == _CERT_EXPIRED:
        return (f"The server certificate of {where} has expired ({exc.verify_message}): renew "
                "the server's certificate (etcd --cert-file).")
    if exc.verify_code == _HOSTNAME_MISMATCH:
        return (f"The server certificate of {where} is not for that address "
                f"({exc.verify_message}): use the host name or IP address in its subject "
                "alternative names in --etcd, or reissue the certificate with this one.")
    return (f"The server certificate of {where} is not trusted by {trusted} "
            f"({exc.verify_message}): pass the CA that signed the server's certificate with "
            "--etcd-cacert / ELASTIC_ETCD_CACERT.")


def _client_certificate_problem(where: str, security: EtcdSecurity, exc: ssl.SSLError) -> str:
    if exc.reason == "WRONG_VERSION_NUMBER":
        return (f"{where} does not speak TLS: use an http:// URL, or start etcd with "
                "--cert-file/--key-file.")
    if not security.cert:
        return (f"{where} refused the connection ({exc.reason}): it requires a client "
                "certificate; pass --etcd-cert and --etcd-key (ELASTIC_ETCD_CERT, "
                "ELASTIC_ETCD_KEY).")
    expiry = certificate_expiry(security.cert)
    now = datetime.datetime.now(datetime.timezone.utc)
    if expiry is not None and expiry < now:
        return (f"The client certificate --etcd-cert {security.cert} expired on "
                f"{expiry:%Y-%m-%d %H:%M} UTC, and {where} refused it: renew the certificate.")
    return (f"{where} refused the client certificate --etcd-cert {security.cert} "
            f"({exc.reason}): it must be signed by a CA the server trusts (etcd "
            "--trusted-ca-file), be valid now, and allow client authentication.")


def certificate_expiry(path: str) -> datetime.datetime | None:
    """When the PEM certificate at ``path`` expires (None: it cannot be read, or the optional
    ``cryptography`` package is not installed)."""
    try:
        from cryptography import x509  # noqa: PLC0415 (optional: only to name an expiry)
    except ImportError:
        return None
    try:
        cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    return cert.not_valid_after_utc
