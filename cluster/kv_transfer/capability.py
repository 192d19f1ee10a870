"""Capability tokens: proof that a `KVHandle` was issued by a worker of this cluster.

A token is an HMAC-SHA256, keyed with the per-cluster secret, over the request id and the block
ids of one lease. The prefill worker mints it when it grants the lease and checks it before
serving `FetchKV` or `ReleaseKV`; everyone else treats it as opaque bytes.

A cancel token is the same HMAC over the request id alone, in a domain of its own (so it is
never a lease's token): the router mints it to cancel a request whose handle it never got
(`CancelPrefill`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from cluster.errors import InvalidArgument

_DOMAIN = b"pdserve.kv-lease.v1\x00"
_CANCEL_DOMAIN = b"pdserve.cancel.v1\x00"
TOKEN_BYTES = hashlib.sha256().digest_size


class Capability:
    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or not secret:
            raise InvalidArgument("the capability secret must be non-empty bytes")
        self._secret = secret

    def token(self, request_id: str, block_ids: Sequence[int]) -> bytes:
        return hmac.new(self._secret, _message(request_id, block_ids), hashlib.sha256).digest()

    def cancel_token(self, request_id: str) -> bytes:
        return hmac.new(
            self._secret, _message(request_id, (), _CANCEL_DOMAIN), hashlib.sha256
        ).digest()

    def verify_cancel(self, request_id: str, token: bytes) -> bool:
        """Constant-time check of a cancel token; False for any malformed input."""
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
            return False
        try:
            expected = self.cancel_token(request_id)
        except UnicodeEncodeError:
            return False
        return hmac.compare_digest(expected, token)

    def verify(self, request_id: str, block_ids: Sequence[int], token: bytes) -> bool:
        """Constant-time check of `token`; False (never an error) for any malformed input."""
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
            return False
        try:
            expected = self.token(request_id, block_ids)
        except (InvalidArgument, UnicodeEncodeError):
            return False
        return hmac.compare_digest(expected, token)


def _message(request_id: str, block_ids: Sequence[int], domain: bytes = _DOMAIN) -> bytes:
    """Length-prefixed fields, so no two (id, blocks) pairs encode to the same bytes."""
    rid = request_id.encode("utf-8")
    parts = [domain, len(rid).to_bytes(8, "big"), rid, len(block_ids).to_bytes(8, "big")]
    for b in block_ids:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 1 << 64:
            raise InvalidArgument(f"block id out of range: {b!r}")
        parts.append(b.to_bytes(8, "big"))
    return b"".join(parts)
