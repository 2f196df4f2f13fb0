"""Test certificates, made with `cryptography`: a CA, and certificates it signs for
127.0.0.1/localhost (usable as server and client certificates)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    cert: str  # PEM file paths
    key: str


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, cert, key) -> Issued:
    cert_file, key_file = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Issued(str(cert_file), str(key_file))


class TestCA:
    __test__ = False  # not a pytest class

    def __init__(self, directory: Path, name: str = "specdecode test CA"):
        self.dir, self.name = directory, name
        self.key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.files = _write(directory / name.replace(" ", "-"), self.cert, self.key)

    @property
    def ca_file(self) -> str:
        return self.files.cert

    def issue(self, name: str, dns_names: tuple[str, ...] = ()) -> Issued:
        """A certificate for 127.0.0.1, localhost and `dns_names`, good for server and
        client auth."""
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"), *map(x509.DNSName, dns_names),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                    critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        return _write(self.dir / name, cert, key)
