"""TLS certificates for the SuperLink and key pairs for SuperNode authentication.

``fedhet certs OUT --host superlink --host 127.0.0.1`` writes ``ca.crt`` /
``ca.key`` (a private CA) and ``server.pem`` / ``server.key`` (the SuperLink's
certificate, with a SAN for every host). ``fedhet keys OUT --nodes N`` writes
``node-<i>`` (private key, OpenSSH format) and ``node-<i>.pub`` (public key,
OpenSSH format, what ``flwr supernode register`` takes): ECDSA P-384; and
``node-<i>.superexec-secret``, the secret node i's SuperNode and its executor share
(``--superexec-auth-secret-file``: Flower reads the file as raw bytes and signs the
executor's task requests with a key derived from it). ``fedhet keys OUT --bundle I
--ca ca.crt`` packs what device i needs, and nothing else, into one archive.
"""

from __future__ import annotations

import datetime as dt
import io
import ipaddress
import os
import secrets
import tarfile
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes, private: bool = False, mode: int = 0o600) -> None:
    """Write ``data``; a private file is created with ``mode`` (never readable by
    others, not even for a moment), replacing what was there."""
    if not private:
        path.write_bytes(data)
        return
    path.unlink(missing_ok=True)  # also a 0400 file of an earlier run
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)


SECRET_SUFFIX = ".superexec-secret"
"""``node-<i>.superexec-secret``: node i's SuperNode / executor secret."""


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


def superexec_secret_path(out_dir: Path, index: int) -> Path:
    return out_dir / f"node-{index}{SECRET_SUFFIX}"


def make_superexec_secrets(out_dir: Path, count: int, start: int = 0) -> list[Path]:
    """One secret per node (32 random bytes as 64 hex characters, no newline), 0400:
    ``node-<i>.superexec-secret``, what ``--superexec-auth-secret-file`` of node i's
    SuperNode and of its executor read. A new secret replaces an old one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(start, start + count):
        path = superexec_secret_path(out_dir, i)
        _write(path, secrets.token_hex(32).encode(), private=True, mode=0o400)
        paths.append(path)
    return paths


BUNDLE_FILES = ("ca.crt", "node.key", "superexec.secret")
"""What a device gets, under ``node-<i>/`` in its bundle: the CA certificate, its own
private key, its executor secret (``scripts/device-install.sh --ca --key
--superexec-secret``)."""


def bundle_node(keys_dir: Path, index: int, ca: Path, out: Path) -> Path:
    """A tar archive (0600) with exactly what node ``index`` needs: ``ca.crt`` (the
    SuperLink's CA certificate), ``node.key`` (its private key) and
    ``superexec.secret``, under ``node-<index>/``, private files 0400. Raises
    FileNotFoundError naming a missing file; refuses a CA *private* key as ``ca``."""
    sources = {
        "ca.crt": ca,
        "node.key": keys_dir / f"node-{index}",
        "superexec.secret": superexec_secret_path(keys_dir, index),
    }
    for name, path in sources.items():
        if not path.is_file():
            hint = {
                "ca.crt": "fedhet certs makes it",
                "node.key": "fedhet keys makes it",
                "superexec.secret": f"fedhet keys {keys_dir} --secrets-only makes it",
            }[name]
            raise FileNotFoundError(f"{path} is missing ({hint})")
    if b"PRIVATE KEY" in ca.read_bytes() or b"BEGIN CERTIFICATE" not in ca.read_bytes():
        raise ValueError(f"{ca} is not a CA certificate (give ca.crt, never ca.key)")
    folder = f"node-{index}"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        dir_info = tarfile.TarInfo(folder)
        dir_info.type, dir_info.mode = tarfile.DIRTYPE, 0o700
        tar.addfile(dir_info)
        for name, path in sources.items():
            data = path.read_bytes()
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size, info.mode = len(data), 0o444 if name == "ca.crt" else 0o400
            info.mtime = int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    out.parent.mkdir(parents=True, exist_ok=True)
    _write(out, buffer.getvalue(), private=True)
    return out
