"""Certificates made at test time (never committed keys): a CA, a loopback server, a client.

``make_certs(directory)`` writes PEM files and returns their paths; the ``tls_certs``
fixture (module scope) does so under a temporary directory, with a second, untrusted CA
for the negative cases. Use it from a test module with
``from tests.certs import tls_certs  # noqa: F401`` and a ``certs`` argument.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = datetime.timedelta(days=1)


@dataclasses.dataclass(frozen=True)
class CertPaths:
    """PEM files: ``ca`` signed ``server_*`` (127.0.0.1, ::1, localhost) and ``client_*``;
    ``rogue_ca`` signed ``rogue_server_*`` for the same names and is trusted by nobody."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    rogue_ca: str
    rogue_server_cert: str
    rogue_server_key: str


class _Authority:
    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        basic = x509.BasicConstraints(ca=True, path_length=0)
        usage = x509.KeyUsage(
            digital_signature=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=True,
            crl_sign=True,
            encipher_only=False,
            decipher_only=False,
        )
        builder = _builder(self.name, self.key.public_key(), self.name)
        builder = builder.add_extension(basic, critical=True).add_extension(usage, critical=True)
        # key identifiers: Python 3.13's default contexts verify with VERIFY_X509_STRICT
        ski = x509.SubjectKeyIdentifier.from_public_key(self.key.public_key())
        builder = builder.add_extension(ski, critical=False)
        self.cert = builder.sign(self.key, hashes.SHA256())

    def issue(
        self, name: str, *, server: bool
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            _builder(subject, key.public_key(), self.name)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
        )
        if server:
            names: list[x509.GeneralName] = [
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")),
            ]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        purpose = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
        return builder.sign(self.key, hashes.SHA256()), key


def _builder(
    subject: x509.Name, public_key: ec.EllipticCurvePublicKey, issuer: x509.Name
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALID)
    )


def _write_cert(path: Path, cert: x509.Certificate) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # as a real key file
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return str(path)


def make_certs(directory: Path) -> CertPaths:
    """Write a fresh CA, server and client certificate (plus a rogue CA and server)."""
    ca, rogue = _Authority("pdproxy test CA"), _Authority("rogue test CA")
    server, server_key = ca.issue("pdproxy test server", server=True)
    client, client_key = ca.issue("pdproxy test client", server=False)
    rogue_server, rogue_key = rogue.issue("rogue test server", server=True)
    return CertPaths(
        ca=_write_cert(directory / "ca.pem", ca.cert),
        server_cert=_write_cert(directory / "server.pem", server),
        server_key=_write_key(directory / "server.key", server_key),
        client_cert=_write_cert(directory / "client.pem", client),
        client_key=_write_key(directory / "client.key", client_key),
        rogue_ca=_write_cert(directory / "rogue-ca.pem", rogue.cert),
        rogue_server_cert=_write_cert(directory / "rogue-server.pem", rogue_server),
        rogue_server_key=_write_key(directory / "rogue-server.key", rogue_key),
    )


@pytest.fixture(scope="module", name="certs")
def tls_certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return make_certs(tmp_path_factory.mktemp("tls"))
