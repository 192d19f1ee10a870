from __future__ import annotations

import pytest

from cluster.errors import InvalidArgument
from cluster.kv_transfer.capability import TOKEN_BYTES, Capability

CAP = Capability(b"cluster-secret")


def test_token_is_deterministic_and_verifies() -> None:
    token = CAP.token("req-1", [3, 4, 5])
    assert len(token) == TOKEN_BYTES == 32
    assert token == Capability(b"cluster-secret").token("req-1", (3, 4, 5))
    assert CAP.verify("req-1", [3, 4, 5], token)


def test_token_binds_secret_request_and_every_block() -> None:
    token = CAP.token("req-1", [3, 4, 5])
    assert not Capability(b"other-secret").verify("req-1", [3, 4, 5], token)
    assert not CAP.verify("req-2", [3, 4, 5], token)
    for blocks in ([3, 4], [3, 4, 5, 6], [5, 4, 3], [3, 4, 6], []):
        assert not CAP.verify("req-1", blocks, token)


def test_encoding_is_unambiguous() -> None:
    # Without length prefixes these pairs could serialise to the same bytes.
    pairs = [
        (("a", [1]), ("a\x00\x00\x00\x00\x00\x00\x00\x01", [])),
        (("ab", []), ("a", [])),
        (("", [0]), ("\x00" * 8, [])),
        (("x", [1, 2]), ("x", [258])),
    ]
    for (rid_a, blocks_a), (rid_b, blocks_b) in pairs:
        assert CAP.token(rid_a, blocks_a) != CAP.token(rid_b, blocks_b)


def test_verify_rejects_malformed_tokens_without_raising() -> None:
    token = CAP.token("req-1", [7])
    tampered = bytes([token[0] ^ 1]) + token[1:]
    for bad in (tampered, token[:-1], token + b"\x00", b"", bytearray(token), "x" * 32, None):
        assert not CAP.verify("req-1", [7], bad)
    assert not CAP.verify("req-1", [-1], token)
    assert not CAP.verify("req-1", [True], token)
    assert not CAP.verify("\ud800", [7], token)  # not encodable as UTF-8


def test_secret_must_be_non_empty_bytes() -> None:
    with pytest.raises(InvalidArgument):
        Capability(b"")
    with pytest.raises(InvalidArgument):
        Capability("secret")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        CAP.token("req-1", [1 << 64])


def test_cancel_token_binds_secret_and_request_and_is_never_a_lease_token() -> None:
    token = CAP.cancel_token("req-1")
    assert len(token) == TOKEN_BYTES and CAP.verify_cancel("req-1", token)
    assert token != CAP.token("req-1", [])  # a domain of its own
    assert not CAP.verify("req-1", [], token)
    assert not CAP.verify_cancel("req-1", CAP.token("req-1", []))
    assert not CAP.verify_cancel("req-2", token)
    assert not Capability(b"other-secret").verify_cancel("req-1", token)
    for bad in (token[:-1], b"", None, "x" * 32, bytearray(token)):
        assert not CAP.verify_cancel("req-1", bad)
    assert not CAP.verify_cancel("\ud800", token)
