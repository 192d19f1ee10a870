"""`pdserve serve`'s client-facing security flags: API keys (`router.api_keys`,
`router.api_key_file`; `$PDSERVE_API_KEY` is read too, when the app is built) and TLS for the
routers' direct endpoints (`router.tls_cert_file`, `router.tls_key_file`). The clients
(`generate`, `status`, `bench`, `profile`) send `$PDSERVE_API_KEY` when it is set."""

from __future__ import annotations

import argparse
from typing import Any


def add_auth_arguments(p: argparse.ArgumentParser) -> None:
    auth = p.add_argument_group("client authentication (docs/deployment.md, Trust boundary)")
    auth.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key every client call must carry (Authorization: Bearer KEY); repeat for "
        "more. A command line is visible to every user of the host: prefer "
        "$PDSERVE_API_KEY or --api-key-file (default: no key, unless $PDSERVE_API_KEY is set)",
    )
    auth.add_argument(
        "--api-key-file",
        default="",
        metavar="FILE",
        help="a file of keys, one a line (# comments)",
    )
    auth.add_argument(
        "--tls-cert-file",
        default="",
        metavar="PEM",
        help="serve the routers' direct gRPC endpoints over TLS with this certificate chain "
        "(with --tls-key-file; default: plaintext)",
    )
    auth.add_argument("--tls-key-file", default="", metavar="PEM", help="its private key")


def auth_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `RouterConfig` fields the flags set."""
    return {
        "api_keys": tuple(args.api_key),
        "api_key_file": args.api_key_file,
        "tls_cert_file": args.tls_cert_file,
        "tls_key_file": args.tls_key_file,
    }
