"""`direct_tls`: the TLS context of the router's direct endpoint (`router.tls_cert_file` and
`router.tls_key_file`, PEM files on the router's node), or None for plaintext.

gRPC clients insist on HTTP/2 chosen by ALPN, so the context offers "h2" only; TLS 1.2 is the
oldest version taken. A missing or unreadable file fails the replica's start, loudly.
"""

from __future__ import annotations

import ssl

from cluster.config import ConfigError


def direct_tls(cert_file: str, key_file: str) -> ssl.SSLContext | None:
    if not cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"router.tls_cert_file / tls_key_file: {e}") from None
    context.set_alpn_protocols(["h2"])
    return context
