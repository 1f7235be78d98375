"""A real etcd with TLS (mutual) and authentication on, for the security tests.

``make_pki`` writes a CA, a server certificate for 127.0.0.1, client certificates (valid and
expired) and a second, unrelated CA into a directory, with the ``cryptography`` package.
``SecureEtcd`` is the embedded etcd started with ``--cert-file/--key-file/--trusted-ca-file
/--client-cert-auth`` on 127.0.0.1 only; ``enable_auth`` adds a root user and one user per job
whose role may read and write that job's prefixes only (the job's and its launchers'), with
etcdctl, exactly as the README's "Security" section tells an operator to.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from elastic.launch.embedded_etcd import EmbeddedEtcd

ROOT_PASSWORD = "root-secret"
DAY = datetime.timedelta(days=1)
# The jobs of the tests' secure etcd, each with its user and password.
JOB_A, JOB_B = "secure-a", "secure-b"
JOB_USERS = {JOB_A: ("alice", "alice-secret"), JOB_B: ("bob", "bob-secret")}


@dataclass(frozen=True)
class Pki:
    """The files of a test PKI."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    expired_cert: Path
    expired_key: Path
    other_ca: Path


def _key_and_name(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Name]:
    return (ec.generate_private_key(ec.SECP256R1()),
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))


def _write(directory: Path, name: str, cert: x509.Certificate,
           key: ec.EllipticCurvePrivateKey | None = None) -> tuple[Path, Path | None]:
    cert_path = directory / f"{name}.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is None:
        return cert_path, None
    key_path = directory / f"{name}-key.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


def _ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key, name = _key_and_name(common_name)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - DAY).not_valid_after(now + 30 * DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str, *,
          server: bool, expired: bool = False) -> tuple[x509.Certificate,
                                                         ec.EllipticCurvePrivateKey]:
    key, name = _key_and_name(common_name)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = (now - 10 * DAY, now - DAY) if expired else (now - DAY, now + 30 * DAY)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(ca.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(directory: Path) -> Pki:
    """Writes a CA, a server certificate for 127.0.0.1, a client certificate, an expired
    client certificate, and an unrelated CA into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _ca("elastic-test-ca")
    other_ca, _ = _ca("some-other-ca")
    server = _write(directory, "server", *_leaf(ca, ca_key, "etcd-server", server=True))
    client = _write(directory, "client", *_leaf(ca, ca_key, "elastic-client", server=False))
    expired = _write(directory, "expired", *_leaf(ca, ca_key, "elastic-client", server=False,
                                                  expired=True))
    return Pki(ca=_write(directory, "ca", ca)[0], server_cert=server[0], server_key=server[1],
               client_cert=client[0], client_key=client[1], expired_cert=expired[0],
               expired_key=expired[1], other_ca=_write(directory, "other-ca", other_ca)[0])


def user_env(pki: Pki, job_id: str) -> dict[str, str]:
    """The ELASTIC_ETCD_* variables of a worker holding ``job_id``'s user."""
    user, password = JOB_USERS[job_id]
    return {"ELASTIC_ETCD_CACERT": str(pki.ca), "ELASTIC_ETCD_CERT": str(pki.client_cert),
            "ELASTIC_ETCD_KEY": str(pki.client_key), "ELASTIC_ETCD_USER": user,
            "ELASTIC_ETCD_PASSWORD": password}


class SecureEtcd(EmbeddedEtcd):
    """The embedded etcd with TLS on its client URL and client certificates required."""

    scheme = "https"

    def __init__(self, pki: Pki, **kw) -> None:
        super().__init__(**kw)
        self.pki = pki

    def _args(self, binary: str, peer_port: int) -> list[str]:
        return super()._args(binary, peer_port) + [
            "--cert-file", str(self.pki.server_cert), "--key-file", str(self.pki.server_key),
            "--trusted-ca-file", str(self.pki.ca), "--client-cert-auth"]

    def _health_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(self.pki.client_cert), str(self.pki.client_key))
        return context

    def etcdctl(self, *args: str, user: str | None = None) -> str:
        """Runs etcdctl against this server (as ``user:password`` when given); returns stdout.

        Raises:
            subprocess.CalledProcessError: etcdctl failed.
        """
        binary = str(Path(self._binary).with_name("etcdctl"))
        auth = ["--user", user] if user else []
        done = subprocess.run(
            [binary, "--endpoints", self.url, "--cacert", str(self.pki.ca), "--cert",
             str(self.pki.client_cert), "--key", str(self.pki.client_key), *auth, *args],
            capture_output=True, text=True, timeout=30, check=False)
        if done.returncode:
            raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout,
                                                done.stderr)
        return done.stdout

    def enable_auth(self) -> None:
        """Adds the root user and turns authentication on."""
        self.etcdctl("user", "add", f"root:{ROOT_PASSWORD}")
        self.etcdctl("auth", "enable")

    def add_job_user(self, job_id: str, user: str, password: str) -> None:
        """Adds ``user`` whose role reads and writes job ``job_id``'s prefixes only."""
        root = f"root:{ROOT_PASSWORD}"
        role = f"job-{job_id}"
        self.etcdctl("role", "add", role, user=root)
        for prefix in (f"/elastic/{job_id}/", f"/elastic/{job_id}.launchers/"):
            self.etcdctl("role", "grant-permission", role, "readwrite", prefix, "--prefix=true",
                         user=root)
        self.etcdctl("user", "add", f"{user}:{password}", user=root)
        self.etcdctl("user", "grant-role", user, role, user=root)
