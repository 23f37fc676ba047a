"""A throw-away PKI for the security tests: CAs, a server cert and client certs (EC P-256)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services.common.security import TlsConfig


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: Issued
    client: Issued
    other_ca: Path
    foreign_client: Issued  # signed by other_ca


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> Issued:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".crt")
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Issued(cert_path, key_path)


def _builder(subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey):
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
    )


def make_ca(path: Path, cn: str) -> tuple[Issued, ec.EllipticCurvePrivateKey, x509.Name]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(cn, _name(cn), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _write(path, key, cert), key, _name(cn)


def issue(
    path: Path,
    cn: str,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    server: bool,
    client: bool = False,
) -> Issued:
    """A leaf cert; server certs name localhost, dapo.internal and 127.0.0.1."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(cn, ca_name, key.public_key())
    if server:
        names = [x509.DNSName("localhost"), x509.DNSName("dapo.internal")]
        names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    oids = x509.oid.ExtendedKeyUsageOID
    usages = [oids.SERVER_AUTH] * server + [oids.CLIENT_AUTH] * (client or not server)
    builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return _write(path, key, builder.sign(ca_key, hashes.SHA256()))


def make_node_cert(root: Path) -> tuple[Path, Issued]:
    """A CA and one cert good as server and client: every process of a `dapo up` run."""
    ca, ca_key, ca_name = make_ca(root / "ca", "dapo run CA")
    return ca.cert, issue(root / "node", "dapo node", ca_key, ca_name, server=True, client=True)


def make_pki(root: Path) -> Pki:
    ca, ca_key, ca_name = make_ca(root / "ca", "dapo test CA")
    other, other_key, other_name = make_ca(root / "other-ca", "another CA")
    return Pki(
        ca=ca.cert,
        server=issue(root / "server", "dapo server", ca_key, ca_name, server=True),
        client=issue(root / "client", "dapo client", ca_key, ca_name, server=False),
        other_ca=other.cert,
        foreign_client=issue(root / "foreign", "intruder", other_key, other_name, server=False),
    )


def server_tls(pki: Pki, mtls: bool = False) -> TlsConfig:
    """The server side of TLS (mTLS when asked) with this PKI's server certificate."""
    return TlsConfig(
        enabled=True, cert=str(pki.server.cert), key=str(pki.server.key), ca=str(pki.ca), mtls=mtls
    )


def client_tls(pki: Pki, issued: Any = None, ca: Path | None = None, **kw: Any) -> TlsConfig:
    """The client side: trust `ca` (this PKI's by default), present `issued` if given."""
    cert = {"cert": str(issued.cert), "key": str(issued.key)} if issued else {}
    return TlsConfig(enabled=True, ca=str(ca or pki.ca), **cert, **kw)
