"""A throwaway CA, a server certificate for loopback and client certificates, made with `openssl` as the
docs/security.md says (ECDSA P-256, one command per certificate)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2"]


@dataclass(frozen=True)
class Certs:
    directory: Path

    def ca(self) -> Path:
        return self.directory / "ca.pem"

    def cert(self, name: str) -> Path:
        return self.directory / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.directory / f"{name}.key"


def make_certs(directory: Path, clients: tuple[str, ...] = ("alice",), ca_name: str = "ca") -> Certs:
    """A CA (`ca_name`.pem), `server` for localhost and 127.0.0.1, and one certificate per client whose
    subject CN is its name. Raises subprocess.CalledProcessError when openssl fails."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / f"{ca_name}.pem", directory / f"{ca_name}.key"
    _openssl("req", "-x509", *KEY, "-keyout", ca_key, "-out", ca, "-subj", f"/CN=draftwire-{ca_name}")
    leaf = ["-CA", ca, "-CAkey", ca_key, "-addext", "basicConstraints=CA:FALSE"]
    _openssl(
        "req", "-x509", *KEY, *leaf, "-keyout", directory / "server.key", "-out", directory / "server.pem",
        "-subj", "/CN=verifier", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
    )  # fmt: skip
    for name in clients:
        _openssl(
            "req", "-x509", *KEY, *leaf, "-keyout", directory / f"{name}.key",
            "-out", directory / f"{name}.pem", "-subj", f"/CN={name}",
        )  # fmt: skip
    return Certs(directory)


def _openssl(*args) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
