"""Writes the seed corpus of the direct endpoint's HTTP/2 fuzz test
(tests/router/direct/test_frame_fuzz.py): whole client byte streams, each a file here named
for what the endpoint must do with it (`expected`): `ok_` a call (or calls) answered, the
connection kept; `refused_` each call refused with an HTTP or gRPC status or a stream reset,
the connection kept; `goaway_` the connection refused with GOAWAY and closed; `unanswered_`
nothing to answer yet or any more (bytes short of a frame, a body that never ends, streams the
client reset), the connection kept. Frames are written byte by byte (`raw`), so a
seed says exactly what goes on the wire. Run `python -m tests.router.direct.corpus.make_corpus`
after changing a seed and commit the result."""

from __future__ import annotations

from pathlib import Path

from hpack import Encoder

from tests.router.direct.h2_client import frame, grpc_headers
from tests.router.direct.rig import request
from tests.router.direct.wire import PREFACE

CORPUS = Path(__file__).parent
EXPECTED = ("ok", "refused", "goaway", "unanswered")

DATA, HEADERS, PRIORITY, RST, SETTINGS, PUSH, PING, GOAWAY, WINDOW, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20


def raw(kind: int, flags: int, stream: int, payload: bytes = b"", length: int | None = None):
    """One frame: 9 header bytes (`length` may lie about the payload) and the payload."""
    n = len(payload) if length is None else length
    return n.to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def settings(*pairs: tuple[int, int], flags: int = 0) -> bytes:
    body = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in pairs)
    return raw(SETTINGS, flags, 0, body)


def block(fields=None) -> bytes:
    return Encoder().encode(fields or grpc_headers())


def headers(stream: int, fields=None, flags: int = END_HEADERS) -> bytes:
    return raw(HEADERS, flags, stream, block(fields))


def message(body: bytes | None = None) -> bytes:
    return frame(request(2).SerializeToString() if body is None else body)


def call(stream: int, fields=None) -> bytes:
    """A whole Generate call: HEADERS, then one DATA frame with the request and END_STREAM."""
    return headers(stream, fields) + raw(DATA, END_STREAM, stream, message())


def window(stream: int, increment: int) -> bytes:
    return raw(WINDOW, 0, stream, increment.to_bytes(4, "big"))


HELLO = PREFACE + settings()


def ok_seeds() -> dict[str, bytes]:
    body = message()
    half = len(block()) // 2
    padded = raw(HEADERS, END_HEADERS | PADDED, 1, b"\x03" + block() + b"\0" * 3)
    return {
        "ok_call": HELLO + settings(flags=ACK) + call(1),
        "ok_padded_and_split": HELLO
        + padded
        + raw(DATA, PADDED, 1, b"\x02" + body[:7] + b"\0\0")
        + raw(DATA, END_STREAM, 1, body[7:])
        + raw(PING, 0, 0, bytes(8))
        + window(0, 1000),
        "ok_continuation_and_reset": HELLO
        + raw(HEADERS, 0, 1, block()[:half])
        + raw(CONTINUATION, END_HEADERS, 1, block()[half:])
        + raw(DATA, END_STREAM, 1, body)
        + headers(3, grpc_headers(grpc_timeout=b"5S"))
        + raw(RST, 0, 3, (8).to_bytes(4, "big")),
        "ok_unary_and_unknown_frame": HELLO
        + raw(0xFA, 0xFF, 1, b"an extension frame is ignored")
        + headers(1, grpc_headers(b"/pdserve.v1.Generation/GetModelInfo"))
        + raw(DATA, END_STREAM, 1, frame(b"")),
        "ok_reset_refusal_then_call": HELLO  # the 405 of stream 1 dropped, h2 forgot it
        + headers(1, [(b":method", b"GET"), *grpc_headers()[1:]])
        + raw(RST, 0, 1, bytes(4))
        + call(3),
        "ok_priority_then_two_calls": HELLO
        + raw(PRIORITY, 0, 1, (3).to_bytes(4, "big") + b"\x10")
        + call(1)
        + call(3),
    }


def refused_seeds() -> dict[str, bytes]:
    def body_of(payload: bytes) -> bytes:
        return HELLO + headers(1) + raw(DATA, END_STREAM, 1, payload)

    big = message(b"\x0a" + b"\x7f" * 4999)  # past max_request_bytes, in a 8 KiB window
    return {
        "refused_no_request": HELLO + headers(1, flags=END_HEADERS | END_STREAM),
        "refused_length_lies": body_of(b"\0\xff\xff\xff\xff" + b"x" * 5),
        "refused_compressed": body_of(frame(b"\x0a\x01x", compressed=True)),
        "refused_not_protobuf": body_of(frame(b"\xff" * 16)),
        "refused_past_the_size_limit": HELLO
        + headers(1)
        + raw(DATA, 0, 1, big[:4000])
        + raw(DATA, END_STREAM, 1, big[4000:]),
        "refused_unknown_method": HELLO + call(1, grpc_headers(b"/pdserve.v1.Generation/Nope")),
        "refused_http_get": HELLO + call(1, [(b":method", b"GET"), *grpc_headers()[1:]]),
        "refused_not_grpc": HELLO
        + call(1, [*grpc_headers()[:4], (b"content-type", b"text/plain")]),
        "refused_bad_timeout": HELLO + call(1, grpc_headers(grpc_timeout=b"1000000000S")),
    }


def goaway_seeds() -> dict[str, bytes]:
    start = HELLO + headers(1)
    many = [(b"x-pad-%d" % i, b"v" * 40) for i in range(40)]  # past max_header_list_bytes
    return {
        "goaway_http1": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        "goaway_no_settings_first": PREFACE + call(1),
        "goaway_oversized_frame": HELLO + raw(DATA, 0, 1, b"x" * 16, length=0xFFFFFF),
        "goaway_oversized_settings": HELLO + raw(SETTINGS, 0, 0, bytes(16386)),
        "goaway_settings_bad_length": HELLO + raw(SETTINGS, 0, 0, bytes(5)),
        "goaway_settings_window_too_big": HELLO + settings((4, 2**31)),
        "goaway_settings_bad_push": HELLO + settings((2, 2)),
        "goaway_settings_tiny_frames": HELLO + settings((5, 100)),
        "goaway_data_bad_padding": start + raw(DATA, PADDED, 1, b"\xc8" + b"x" * 10),
        "goaway_headers_bad_padding": HELLO + raw(HEADERS, END_HEADERS | PADDED, 1, b"\x40xx"),
        "goaway_data_on_stream_0": HELLO + raw(DATA, 0, 0, b"x"),
        "goaway_headers_on_even_stream": HELLO + call(2),
        "goaway_stream_ids_go_back": HELLO + call(5) + call(3),
        "goaway_too_many_streams": HELLO + b"".join(headers(s) for s in range(1, 19, 2)),
        "goaway_continuation_flood": HELLO
        + raw(HEADERS, 0, 1, block())
        + b"".join(raw(CONTINUATION, 0, 1, b"\x40\x01a\x0b" + b"b" * 11) for _ in range(1000)),
        "goaway_continuation_interrupted": HELLO
        + raw(HEADERS, 0, 1, block()[:4])
        + raw(DATA, 0, 1, b"x"),
        "goaway_continuation_alone": HELLO + raw(CONTINUATION, END_HEADERS, 1, block()),
        "goaway_headers_too_large": HELLO + headers(1, grpc_headers() + many),
        "goaway_hpack_garbage": HELLO + raw(HEADERS, END_HEADERS, 1, b"\xff" * 20),
        "goaway_hpack_table_too_big": HELLO
        + raw(HEADERS, END_HEADERS, 1, b"\x3f\xe1\xff\xff\xff\x03" + block()),
        "goaway_uppercase_header": HELLO + call(1, [*grpc_headers(), (b"X-Upper", b"1")]),
        "goaway_pseudo_header_last": HELLO + call(1, [*grpc_headers()[1:], (b":method", b"POST")]),
        "goaway_push_promise": HELLO + raw(PUSH, END_HEADERS, 1, bytes(4) + block()),
        "goaway_ping_bad_length": HELLO + raw(PING, 0, 0, bytes(7)),
        "goaway_ping_flood": HELLO
        + b"".join(raw(PING, 0, 0, i.to_bytes(8, "big")) for i in range(300)),
        "goaway_window_overflow": HELLO + window(0, 2**31 - 1) + window(0, 2**31 - 1),
        "goaway_window_zero": HELLO + window(0, 0),
        "goaway_past_the_stream_window": start + raw(DATA, 0, 1, bytes(9000)),
        "goaway_priority_on_itself": HELLO + raw(PRIORITY, 0, 1, (1).to_bytes(4, "big") + b"\x10"),
    }


def unanswered_seeds() -> dict[str, bytes]:
    return {
        "unanswered_preface_cut": PREFACE[:10],
        "unanswered_frame_cut": HELLO + raw(HEADERS, END_HEADERS, 1, block()[:5], length=100),
        "unanswered_body_never_ends": HELLO + headers(1) + raw(DATA, 0, 1, message()[:6]),
        "unanswered_reset_before_its_refusal": HELLO
        + headers(1, [*grpc_headers()[:4], (b"content-type", b"text/plain")])
        + raw(RST, 0, 1, bytes(4)),
        "unanswered_client_goaway_after_a_call": HELLO
        + call(1, grpc_headers(b"/pdserve.v1.Generation/Nope"))
        + raw(GOAWAY, 0, 0, bytes(8)),
        "unanswered_rapid_reset": HELLO
        + b"".join(headers(s) + raw(RST, 0, s, bytes(4)) for s in range(1, 200, 2)),
    }


def seeds() -> dict[str, bytes]:
    return {**ok_seeds(), **refused_seeds(), **goaway_seeds(), **unanswered_seeds()}


def main() -> None:
    for stale in CORPUS.glob("*.bin"):
        stale.unlink()
    for name, data in seeds().items():
        assert name.split("_")[0] in EXPECTED, name
        (CORPUS / f"{name}.bin").write_bytes(data)


if __name__ == "__main__":
    main()
