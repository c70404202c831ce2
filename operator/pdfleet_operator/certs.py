"""Certificates for the dev webhook (``--webhook dev``), the local control plane and test webhooks.

One CA signs everything: the apiserver's serving certificate doubles as the
admin client certificate (CN=admin, O=system:masters), as envtest does, and
webhook servers get their own leaf with an IP SAN of 127.0.0.1.  Keys are
EC P-256: generating them is fast, which matters on 2 cores.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertificateAuthority", "KeyPair", "write_service_account_key"]


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its key, as PEM bytes, plus where they were written."""

    cert_pem: bytes
    key_pem: bytes
    cert_path: Path
    key_path: Path


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, private: bool) -> None:
    path.write_bytes(data)
    path.chmod(0o600 if private else 0o644)


class CertificateAuthority:
    """A throw-away CA whose certificates live in ``directory``."""

    def __init__(self, directory: Path, name: str = "pdfleet-dev-ca") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert_pem = self.cert.public_bytes(serialization.Encoding.PEM)
        self.cert_path = directory / "ca.crt"
        _write(self.cert_path, self.cert_pem, private=False)
        _write(directory / "ca.key", _key_pem(self._key), private=True)

    def issue(
        self,
        name: str,
        *,
        common_name: str,
        organizations: tuple[str, ...] = (),
        ips: tuple[str, ...] = ("127.0.0.1",),
        dns: tuple[str, ...] = ("localhost",),
        server: bool = True,
        client: bool = False,
    ) -> KeyPair:
        """Issue a leaf certificate valid for the given SANs and usages."""
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        sans += [x509.DNSName(d) for d in dns]
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        key_pem = _key_pem(key)
        cert_path, key_path = self.directory / f"{name}.crt", self.directory / f"{name}.key"
        _write(cert_path, cert_pem, private=False)
        _write(key_path, key_pem, private=True)
        return KeyPair(cert_pem, key_pem, cert_path, key_path)


def write_service_account_key(directory: Path) -> tuple[Path, Path]:
    """RSA key pair for signing service-account tokens (the apiserver wants RSA or EC)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    priv, pub = directory / "sa.key", directory / "sa.pub"
    _write(priv, _key_pem(key), private=True)
    _write(
        pub,
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
        private=False,
    )
    return priv, pub
