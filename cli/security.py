"""TLS certificates for the SuperLink and key pairs for SuperNode authentication.

``fedhet certs OUT --host superlink --host 127.0.0.1`` writes ``ca.crt`` /
``ca.key`` (a private CA) and ``server.pem`` / ``server.key`` (the SuperLink's
certificate, with a SAN for every host). ``fedhet keys OUT --nodes N`` writes
``node-<i>`` (private key, OpenSSH format) and ``node-<i>.pub`` (public key,
OpenSSH format, what ``flwr supernode register`` takes): ECDSA P-384.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_certificates(out_dir: Path, hosts: Sequence[str], days: int = 365) -> dict[str, Path]:
    """A CA and a SuperLink certificate valid for ``hosts``; returns the paths."""
    if not hosts:
        raise ValueError("give at least one --host the SuperLink is reached by")
    out_dir.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedhet CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA384())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    paths = {name: out_dir / name for name in ("ca.crt", "ca.key", "server.pem", "server.key")}
    _write(paths["ca.crt"], ca.public_bytes(serialization.Encoding.PEM))
    _write(paths["ca.key"], _pem_key(ca_key), private=True)
    _write(paths["server.pem"], cert.public_bytes(serialization.Encoding.PEM))
    _write(paths["server.key"], _pem_key(key), private=True)
    return paths


def make_node_keys(out_dir: Path, count: int, start: int = 0) -> list[tuple[Path, Path]]:
    """``count`` ECDSA P-384 key pairs (OpenSSH format) for SuperNode authentication."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pairs = []
    for i in range(start, start + count):
        key = ec.generate_private_key(ec.SECP384R1())
        private = out_dir / f"node-{i}"
        public = out_dir / f"node-{i}.pub"
        _write(
            private,
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            ),
            private=True,
        )
        _write(
            public,
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
            + b"\n",
        )
        pairs.append((private, public))
    return pairs
