"""A throwaway self-signed certificate for tests of the direct endpoint's TLS."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(out: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) in `out`, valid a day for localhost and 127.0.0.1; skips the test
    where openssl is missing."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = out / "cert.pem", out / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return cert, key
