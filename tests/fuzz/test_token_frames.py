"""Fuzzing the token stream's decoders (cluster/serving/token_wire.py), which the router runs on
every frame a worker sends: `read_frame` (header: magic, version, length) and `decode_items`
(the msgpack payload). Whatever the bytes, each returns a value or raises InvalidArgument with
its documented message, and sizes nothing from a claimed length."""

from __future__ import annotations

import asyncio
import math

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.errors import InvalidArgument
from cluster.serving import token_wire
from cluster.serving.pool_messages import WorkerChunk
from tests.fuzz.fuzzing import fuzz, mutated, peak_bytes, seeds, with_seeds

MESSAGES = ("token frame", "token item", "token stream ended", "not a token frame")


def decode(payload: bytes) -> list[tuple[bytes, WorkerChunk]] | None:
    """`decode_items`, with InvalidArgument (its only refusal) checked and mapped to None."""
    try:
        items = token_wire.decode_items(payload)
    except InvalidArgument as exc:
        assert exc.message.startswith(MESSAGES), exc.message
        return None
    for key, chunk in items:  # what it returns is what the router may rely on
        assert type(key) is bytes and len(key) == token_wire.KEY_BYTES
        o = chunk.output
        assert all(type(t) is int and t >= 0 for t in o.token_ids)
        assert len(o.logprobs) in (0, len(o.token_ids))
        assert o.finish_reason in (None, "stop", "length", "abort", "prefilled")
        assert all(math.isfinite(x) and x >= 0 for x in (o.queue_seconds, chunk.prefill_seconds))
    return items


def read(stream: bytes, most: int = 1 << 30) -> list[bytes] | None:
    """The first `most` frames `read_frame` takes out of `stream` (all it holds, by default),
    or None once it refuses one."""

    async def frames() -> list[bytes] | None:
        reader = asyncio.StreamReader(limit=1 << 16)
        reader.feed_data(stream)
        reader.feed_eof()
        out: list[bytes] = []
        while len(out) < most:
            try:
                payload = await token_wire.read_frame(reader)
            except InvalidArgument as exc:
                assert exc.message.startswith(MESSAGES), exc.message
                return None
            if payload is None:
                break
            assert len(payload) <= token_wire.MAX_FRAME_BYTES
            out.append(payload)
        return out

    return asyncio.run(frames())


def payload(frame: bytes) -> bytes:
    return frame[token_wire.HEADER.size :]


def test_every_seed_is_a_valid_frame_that_survives_a_round_trip():
    for frame in seeds("token_frame"):
        (body,) = read(frame)
        items = decode(body)
        assert items is not None
        assert token_wire.encode_frame(items) == frame


@fuzz(600)
@with_seeds("token_frame")
@given(st.binary(max_size=512) | mutated(st.sampled_from(seeds("token_frame"))))
def test_any_bytes_as_a_stream_of_frames(stream: bytes):
    frames = read(stream)
    for body in frames or ():
        decode(body)


@fuzz(800)
@given(
    st.binary(max_size=512) | mutated(st.sampled_from([payload(f) for f in seeds("token_frame")]))
)
def test_any_bytes_as_a_payload(body: bytes):
    decode(body)


# Any msgpack value: what a hostile worker could put in any field of an item.
ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=12,
)


@st.composite
def field_swapped(draw) -> bytes:
    """A seed frame's items with fields replaced by any msgpack value, dropped or added."""
    items = msgpack.unpackb(payload(draw(st.sampled_from(seeds("token_frame")[:2]))))
    for _ in range(draw(st.integers(1, 3))):
        item = items[draw(st.integers(0, len(items) - 1))]
        at = draw(st.integers(0, len(item) - 1))
        op = draw(st.sampled_from(("replace", "replace", "drop", "add")))
        if op == "replace":
            item[at] = draw(ANY)
        elif op == "drop":
            del item[at]
        else:
            item.insert(at, draw(ANY))
    return msgpack.packb(items, use_bin_type=True)


@fuzz(600)
@given(field_swapped())
def test_wrong_types_and_arities_in_any_field(body: bytes):
    decode(body)


@fuzz(300)
@given(st.integers(0, (1 << 32) - 1), st.binary(max_size=64))
def test_a_claimed_length_is_refused_before_anything_is_read(length: int, tail: bytes):
    frame = token_wire.HEADER.pack(token_wire.MAGIC, token_wire.VERSION, length) + tail
    got = read(frame, most=1)
    if length > token_wire.MAX_FRAME_BYTES or length > len(tail):
        assert got is None
    else:
        assert got is not None and got[0] == tail[:length]


@fuzz(200)
@given(mutated(st.sampled_from([payload(f) for f in seeds("token_frame")])))
def test_decoding_allocates_in_proportion_to_the_payload(body: bytes):
    # msgpack builds at most one object per byte: ~100 bytes of Python objects per byte.
    assert peak_bytes(lambda: token_wire.decode_items(body)) <= 200 * len(body) + (64 << 10)


@pytest.mark.parametrize(
    "header",
    [
        b"\xdd\xff\xff\xff\xff",  # an array that claims 2**32 - 1 items
        b"\xdb\xff\xff\xff\xff",  # a string of 2**32 - 1 bytes
        b"\xc6\xff\xff\xff\xff",  # a binary of 2**32 - 1 bytes
    ],
)
def test_a_payload_claiming_four_billion_items_is_refused_without_allocating(header: bytes):
    body = header + b"\x00" * 16
    assert decode(body) is None
    assert peak_bytes(lambda: token_wire.decode_items(body)) < 64 << 10
