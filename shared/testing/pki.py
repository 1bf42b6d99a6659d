"""Throw-away certificates for the TLS tests: a CA and one leaf it signed (server and client use, SAN 127.0.0.1
and localhost), written as PEM files."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def make_pki(tmp: Path, tag: str) -> dict[str, Path]:
    """{"ca", "cert", "key"}: PEM files under `tmp`, named by `tag` (two tags give two unrelated CAs)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert(f"upesi test CA {tag}", _name(f"upesi test CA {tag}"), ca_key, ca_key, ca=True)
    leaf = _cert("upesi service", ca.subject, ca_key, leaf_key, ca=False)
    files = {"ca": tmp / f"{tag}-ca.pem", "cert": tmp / f"{tag}-cert.pem", "key": tmp / f"{tag}-key.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    return files


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, issuer, issuer_key, key, ca: bool):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = (b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                          x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False))
    return b.sign(issuer_key, hashes.SHA256())
