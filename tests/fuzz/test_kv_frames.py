"""Fuzzing the `grpc` KV transport's decoders, which a decode worker runs on every chunk a
prefill worker streams: `kv_frame.decode_frame` (the KVChunk message), the chunk header and
`ChunkAssembler.add` (cluster/kv_transfer/kv_wire.py), and the collective transports'
announcement check. Whatever the bytes, each refuses with InvalidArgument (malformed) or
FailedPrecondition (another layout), writes nothing of a refused chunk, and allocates only what
the receiver's own layout and cap allow."""

from __future__ import annotations

import msgpack
import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from cluster.errors import FailedPrecondition, InvalidArgument
from cluster.kv_transfer import kv_frame
from cluster.kv_transfer.collective.collective_kv_client import _check_announcement
from cluster.kv_transfer.kv_wire import ChunkAssembler
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from tests.fuzz.fuzzing import fuzz, mutated, peak_bytes, seeds, with_seeds
from tests.fuzz.make_corpus import LAYOUT, kv_handle, kv_tensors

REFUSALS = (InvalidArgument, FailedPrecondition)
NUM_BLOCKS, NUM_TOKENS = 3, 5  # the seed chunks' handle


def assembler(**kw) -> ChunkAssembler:
    return ChunkAssembler(LAYOUT, NUM_BLOCKS, NUM_TOKENS, max_blocks=8, **kw)


def add_frame(asm: ChunkAssembler, raw: bytes) -> bool:
    """Decode and add one KVChunk message: True if taken. A refusal leaves `asm` unchanged."""
    before = (asm.k.clone(), asm.v.clone(), asm._covered.clone(), asm.bytes_received)
    try:
        header, data = kv_frame.decode_frame(raw)
        asm.add(header, data)
        return True
    except REFUSALS as exc:
        assert exc.message.startswith("KV chunk"), exc.message
        after = (asm.k, asm.v, asm._covered)
        assert all(torch.equal(a, b) for a, b in zip(before[:3], after, strict=True))
        assert asm.bytes_received == before[3]
        return False


def test_the_seed_chunks_assemble_the_kv_bit_exact():
    want_k, want_v = kv_tensors(NUM_BLOCKS)
    for first, last in ((0, 4), (4, 5)):  # one layer a chunk, then all in one
        asm = assembler()
        assert all(add_frame(asm, raw) for raw in seeds("kv_chunk")[first:last])
        got = asm.finish()
        assert torch.equal(got.k, want_k) and torch.equal(got.v, want_v)


@fuzz(700)
@with_seeds("kv_chunk")
@given(st.binary(max_size=600) | mutated(st.sampled_from(seeds("kv_chunk"))))
def test_any_bytes_as_a_chunk(raw: bytes):
    add_frame(assembler(), raw)


# Any header value: what a hostile sender could put in a field.
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.sampled_from((0, 1, 2, 3, 4, -1, 1 << 31, 1 << 32)),
    st.floats(),
    st.text(max_size=40),
    st.binary(max_size=8),
    st.lists(st.integers(-4, 1 << 33), max_size=9),
)


@st.composite
def hostile_chunk(draw) -> bytes:
    """A seed chunk whose header fields are replaced, dropped or added, and whose data is cut,
    padded or replaced."""
    header, data = kv_frame.decode_frame(draw(st.sampled_from(seeds("kv_chunk"))))
    h = msgpack.unpackb(header)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(h) + ["extra"]))
        if draw(st.booleans()) or key == "extra":
            h[key] = draw(ANY)
        else:
            h.pop(key, None)
    body = bytes(data)
    choice = draw(st.sampled_from(("keep", "keep", "cut", "pad", "new")))
    if choice == "cut":
        body = body[: draw(st.integers(0, len(body)))]
    elif choice == "pad":
        body += bytes(draw(st.integers(1, 64)))
    elif choice == "new":
        body = draw(st.binary(max_size=300))
    packed = msgpack.packb(h, use_bin_type=True)
    return kv_frame.encode_frame(packed, body) if body else packed


@fuzz(600)
@given(hostile_chunk())
def test_hostile_header_fields_and_data_lengths(raw: bytes):
    asm = assembler(verify_checksum=True)
    add_frame(asm, raw)


@fuzz(150)
@given(st.lists(st.sampled_from(seeds("kv_chunk")[:4]), max_size=6))
def test_chunks_in_any_order_and_repeated_are_taken_once_or_refused(order: list[bytes]):
    asm = assembler()
    taken = [add_frame(asm, raw) for raw in order]
    assert sum(taken) == len(set(order))  # a repeat is refused
    try:
        asm.finish()
        assert len(set(order)) == 4
    except InvalidArgument as exc:
        assert "missing" in exc.message and len(set(order)) < 4


@fuzz(400)
@given(
    st.integers(-(1 << 40), 1 << 40) | st.booleans(),
    st.integers(-(1 << 40), 1 << 40) | st.booleans(),
)
def test_claimed_block_and_token_counts_allocate_at_most_the_cap(num_blocks, num_tokens):
    """A handle's counts size the assembler's buffers: refused past `max_blocks` before any
    allocation, else sized by the receiver's own layout."""
    cap = 8
    block = 2 * LAYOUT.num_layers * LAYOUT.block_size * LAYOUT.num_kv_heads * LAYOUT.head_dim * 4

    def make() -> None:
        ChunkAssembler(LAYOUT, num_blocks, num_tokens, max_blocks=cap)

    try:
        make()
    except InvalidArgument as exc:
        assert "KV" in exc.message, exc.message
    assert peak_bytes(make) <= cap * block + (64 << 10)


@fuzz(500)
@given(
    st.text(max_size=12),
    st.lists(st.integers(0, (1 << 32) - 1), max_size=8),
    st.integers(0, (1 << 64) - 1),
    st.integers(0, (1 << 32) - 1),
)
def test_a_collective_announcement_is_checked_before_the_receive_is_allocated(
    dtype: str, shape: list[int], nbytes: int, tag: int
):
    handle = kv_handle("r1", (0, 1, 2), NUM_TOKENS)
    want = (LAYOUT.num_layers, NUM_BLOCKS, *LAYOUT.block_shape)
    response = pb.PushKVResponse(dtype=dtype, shape=shape, nbytes=nbytes, tag=tag)
    try:
        _check_announcement(response, LAYOUT, want, handle)
    except (FailedPrecondition, InvalidArgument) as exc:
        assert "KV" in exc.message
        return
    except Exception as exc:  # Unavailable: malformed nbytes or tag
        assert type(exc).__name__ == "Unavailable", exc
        return
    assert (dtype, tuple(shape), tag % 2) == (LAYOUT.dtype, want, 0)
    assert nbytes == int(np.prod(want)) * 4
