from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import msgpack
import numpy as np
import pytest
import torch

from cluster.engine.kv_cache import KVLayout
from cluster.errors import FailedPrecondition, InvalidArgument
from cluster.kv_transfer.kv_frame import decode_frame, encode_frame
from cluster.kv_transfer.kv_wire import (
    MAX_HEADER_BYTES,
    ChunkAssembler,
    checksum,
    chunk_ranges,
    encode_chunks,
    gather_chunks,
    unit_bytes,
)
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb

LAYOUT = KVLayout("m@abc", "float32", num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)
UNIT = unit_bytes(LAYOUT)  # 2 * 4 * 2 * 4 * 4 = 256 bytes
NUM_TOKENS = 18
NUM_BLOCKS = 5


def kv(layout: KVLayout = LAYOUT, num_blocks: int = NUM_BLOCKS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, num_blocks, *layout.block_shape)
    dtype = getattr(torch, layout.dtype)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return k, v


def assembler(layout: KVLayout = LAYOUT) -> ChunkAssembler:
    asm = ChunkAssembler(layout, NUM_BLOCKS, NUM_TOKENS, max_blocks=64)
    asm.k.zero_()
    asm.v.zero_()
    return asm


def chunks(max_chunk_bytes: int = 2 * UNIT) -> list[tuple[bytes, bytes]]:
    k, v = kv()
    return [(header, bytes(data)) for header, data in encode_chunks(k, v, max_chunk_bytes)]


def untouched(asm: ChunkAssembler) -> bool:
    return not asm.k.any() and not asm.v.any() and not asm._covered.any()


# -- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("max_chunk_bytes", [UNIT, 3 * UNIT, 5 * UNIT, 11 * UNIT, 1 << 20])
def test_round_trip(dtype: str, max_chunk_bytes: int) -> None:
    layout = replace(LAYOUT, dtype=dtype)
    k, v = kv(layout)
    asm = ChunkAssembler(layout, NUM_BLOCKS, NUM_TOKENS, max_blocks=NUM_BLOCKS)
    pieces = list(encode_chunks(k, v, max_chunk_bytes))
    for header, data in pieces:
        assert len(data) <= max_chunk_bytes
        asm.add(header, data)
    out = asm.finish()
    assert out.layout == layout and out.num_tokens == NUM_TOKENS
    assert out.k.dtype == k.dtype
    # Bitwise equality (bf16 has no numpy type; it travels as raw bytes).
    assert torch.equal(out.k.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(out.v.view(torch.uint8), v.view(torch.uint8))
    assert asm.bytes_received == k.numel() * k.element_size() * 2
    unit = unit_bytes(layout)
    if max_chunk_bytes >= NUM_BLOCKS * unit:
        # Whole layers per chunk when a layer fits; otherwise runs of blocks of one layer.
        per_chunk = max_chunk_bytes // (NUM_BLOCKS * unit)
        assert len(pieces) == -(-LAYOUT.num_layers // per_chunk)
    else:
        per_chunk = max_chunk_bytes // unit
        assert len(pieces) == LAYOUT.num_layers * -(-NUM_BLOCKS // per_chunk)


def test_chunks_arrive_in_any_order_and_layer_offset() -> None:
    k, v = kv()
    asm = ChunkAssembler(LAYOUT, NUM_BLOCKS, NUM_TOKENS, max_blocks=NUM_BLOCKS)
    pieces = list(encode_chunks(k[:1], v[:1], 2 * UNIT))
    pieces += list(encode_chunks(k[1:], v[1:], 2 * UNIT, layer_offset=1))
    for header, data in reversed(pieces):
        asm.add(header, data)
    out = asm.finish()
    assert torch.equal(out.k, k) and torch.equal(out.v, v)


def test_header_is_the_documented_map() -> None:
    header, data = chunks(2 * UNIT)[0]
    h = msgpack.unpackb(header)
    assert h == {
        "layer_start": 0,
        "layer_end": 1,
        "block_start": 0,
        "block_end": 2,
        "dtype": "float32",
        "shape": [1, 2, 2, 4, 2, 4],
        "nbytes": 2 * UNIT,
        "checksum": checksum(data),
    }
    k, v = kv()
    piece = torch.frombuffer(bytearray(data), dtype=torch.float32).view(h["shape"])
    assert torch.equal(piece[:, 0], k[0:1, 0:2]) and torch.equal(piece[:, 1], v[0:1, 0:2])


def test_encode_refuses_a_bound_below_one_block_of_one_layer() -> None:
    k, v = kv()
    with pytest.raises(InvalidArgument):
        list(encode_chunks(k, v, UNIT - 1))


# -- tampering: every malformed chunk is refused before anything is copied ---------------


def retag(header: bytes, **changes) -> bytes:
    h = msgpack.unpackb(header)
    for key, value in changes.items():
        if value is DROP:
            del h[key]
        else:
            h[key] = value
    return msgpack.packb(h)


DROP = object()
HUGE = 1 << 62


def recrc(data: bytes) -> int:
    return checksum(data)


# (name, error, tamper(header, data) -> (header, data))
TAMPERS: list[tuple[str, type[Exception], Callable[[bytes, bytes], tuple[bytes, bytes]]]] = [
    ("extra key", InvalidArgument, lambda h, d: (retag(h, extra=1), d)),
    ("missing key", InvalidArgument, lambda h, d: (retag(h, checksum=DROP), d)),
    ("string int", InvalidArgument, lambda h, d: (retag(h, layer_start="0"), d)),
    ("float int", InvalidArgument, lambda h, d: (retag(h, block_end=2.0), d)),
    ("bool int", InvalidArgument, lambda h, d: (retag(h, layer_end=True), d)),
    ("nil nbytes", InvalidArgument, lambda h, d: (retag(h, nbytes=None), d)),
    ("int dtype", InvalidArgument, lambda h, d: (retag(h, dtype=4), d)),
    ("string shape", InvalidArgument, lambda h, d: (retag(h, shape="1,2"), d)),
    ("float in shape", InvalidArgument, lambda h, d: (retag(h, shape=[1, 2, 2, 4, 2, 4.0]), d)),
    ("negative start", InvalidArgument, lambda h, d: (retag(h, layer_start=-1), d)),
    ("layer past end", InvalidArgument, lambda h, d: (retag(h, layer_start=3, layer_end=4), d)),
    ("block past end", InvalidArgument, lambda h, d: (retag(h, block_start=4, block_end=6), d)),
    ("empty layers", InvalidArgument, lambda h, d: (retag(h, layer_end=0), d)),
    ("empty blocks", InvalidArgument, lambda h, d: (retag(h, block_start=2), d)),
    ("reversed range", InvalidArgument, lambda h, d: (retag(h, block_start=2, block_end=0), d)),
    ("huge range", InvalidArgument, lambda h, d: (retag(h, layer_end=HUGE), d)),
    ("wrong dtype", FailedPrecondition, lambda h, d: (retag(h, dtype="float16"), d)),
    ("unknown dtype", FailedPrecondition, lambda h, d: (retag(h, dtype="complex128"), d)),
    ("wrong shape", FailedPrecondition, lambda h, d: (retag(h, shape=[1, 2, 2, 4, 4, 2]), d)),
    ("short shape", FailedPrecondition, lambda h, d: (retag(h, shape=[1, 2, 2, 32]), d)),
    ("huge shape", FailedPrecondition, lambda h, d: (retag(h, shape=[HUGE, 2, 2, 4, 2, 4]), d)),
    ("nbytes vs data", InvalidArgument, lambda h, d: (retag(h, nbytes=len(d) - 4), d[:-4])),
    ("huge nbytes", InvalidArgument, lambda h, d: (retag(h, nbytes=HUGE), d)),
    ("short data", InvalidArgument, lambda h, d: (retag(h, checksum=recrc(d[:-4])), d[:-4])),
    ("long data", InvalidArgument, lambda h, d: (h, d + b"\x00" * 4)),
    ("flipped byte", InvalidArgument, lambda h, d: (h, bytes([d[0] ^ 1]) + d[1:])),
    ("wrong checksum", InvalidArgument, lambda h, d: (retag(h, checksum=recrc(d) ^ 1), d)),
    ("negative checksum", InvalidArgument, lambda h, d: (retag(h, checksum=-1), d)),
    ("msgpack list", InvalidArgument, lambda h, d: (msgpack.packb([0, 1, 0, 2]), d)),
    ("msgpack int", InvalidArgument, lambda h, d: (msgpack.packb(5), d)),
    ("msgpack nil", InvalidArgument, lambda h, d: (msgpack.packb(None), d)),
    ("not msgpack", InvalidArgument, lambda h, d: (b"\xc1", d)),
    ("truncated", InvalidArgument, lambda h, d: (h[:-3], d)),
    ("trailing bytes", InvalidArgument, lambda h, d: (h + b"\x00", d)),
    ("empty header", InvalidArgument, lambda h, d: (b"", d)),
    ("int map keys", InvalidArgument, lambda h, d: (msgpack.packb({1: 2}), d)),
    ("bin value", InvalidArgument, lambda h, d: (retag(h, dtype=b"float32"), d)),
    ("long string", InvalidArgument, lambda h, d: (retag(h, dtype="f" * 100), d)),
    ("long array", InvalidArgument, lambda h, d: (retag(h, shape=[1] * 100), d)),
    ("big map", InvalidArgument, lambda h, d: (msgpack.packb({str(i): i for i in range(40)}), d)),
    ("long header", InvalidArgument, lambda h, d: (b"\x00" * (MAX_HEADER_BYTES + 1), d)),
    ("declared huge bin", InvalidArgument, lambda h, d: (b"\xc6\xff\xff\xff\xff", d)),
    ("declared huge map", InvalidArgument, lambda h, d: (b"\xdf\xff\xff\xff\xff", d)),
]


@pytest.mark.parametrize("name,error,tamper", TAMPERS, ids=[t[0] for t in TAMPERS])
def test_tampered_chunk_is_rejected_before_any_copy(name, error, tamper) -> None:
    header, data = chunks(2 * UNIT)[0]
    asm = assembler()
    bad_header, bad_data = tamper(header, data)
    with pytest.raises(error):
        asm.add(bad_header, bad_data)
    assert untouched(asm), name
    asm.add(header, data)  # the genuine chunk is still accepted


def test_repeated_and_overlapping_chunks_are_rejected() -> None:
    pieces = chunks(2 * UNIT)  # layer 0: blocks [0, 2), [2, 4), [4, 5); then layers 1, 2
    asm = assembler()
    asm.add(*pieces[0])
    k_before, v_before = asm.k.clone(), asm.v.clone()
    with pytest.raises(InvalidArgument):
        asm.add(*pieces[0])
    # Blocks [1, 3) of layer 0, self-consistent, but block 1 already arrived.
    k, v = kv()
    (header, data), *_ = encode_chunks(k[:1, 1:3], v[:1, 1:3], 2 * UNIT)
    with pytest.raises(InvalidArgument):
        asm.add(retag(header, block_start=1, block_end=3), data)
    assert torch.equal(asm.k, k_before) and torch.equal(asm.v, v_before)
    assert int(asm._covered.sum()) == 2


def test_incomplete_stream_is_rejected() -> None:
    pieces = chunks(2 * UNIT)
    asm = assembler()
    for piece in pieces[:-1]:
        asm.add(*piece)
    with pytest.raises(InvalidArgument, match="missing"):
        asm.finish()
    asm.add(*pieces[-1])
    asm.finish()
    with pytest.raises(InvalidArgument):
        asm.add(*pieces[0])


def test_assembler_checks_sizes_before_allocating() -> None:
    with pytest.raises(InvalidArgument, match="cap"):
        ChunkAssembler(LAYOUT, 1 << 40, (1 << 40) * LAYOUT.block_size, max_blocks=1024)
    for num_blocks, num_tokens in [(4, NUM_TOKENS), (6, NUM_TOKENS), (0, 0), (1, -1)]:
        with pytest.raises(InvalidArgument):
            ChunkAssembler(LAYOUT, num_blocks, num_tokens, max_blocks=64)
    with pytest.raises(InvalidArgument):
        ChunkAssembler(LAYOUT, True, 1, max_blocks=64)  # type: ignore[arg-type]
    with pytest.raises(FailedPrecondition):
        ChunkAssembler(replace(LAYOUT, dtype="int8"), NUM_BLOCKS, NUM_TOKENS, max_blocks=64)


def test_receiver_layout_mismatch_is_a_failed_precondition() -> None:
    asm = ChunkAssembler(replace(LAYOUT, head_dim=8), NUM_BLOCKS, NUM_TOKENS, max_blocks=64)
    header, data = chunks(2 * UNIT)[0]
    with pytest.raises(FailedPrecondition):
        asm.add(header, data)


# -- the checksum -------------------------------------------------------------------------


def slow_checksum(data: bytes) -> int:
    """The definition in `checksum`'s docstring, word by word: the oracle for the numpy one."""
    data = data + bytes(-len(data) % 4)
    a = b = 0
    for i in range(len(data) // 4):
        w = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        a += w
        b += (i + 1) * w
    return (b % 2**32) << 32 | a % 2**32


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 1000, 4 * 4096 - 4, 4 * 4096, 4 * 4096 * 3 + 7])
def test_checksum_matches_its_definition(size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    data = bytes(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).tolist())
    assert checksum(data) == slow_checksum(data)
    assert checksum(memoryview(data)) == checksum(np.frombuffer(data, dtype=np.uint8))
    if size % 4 == 0:
        assert checksum(np.frombuffer(data, dtype=np.int32)) == slow_checksum(data)


def test_checksum_catches_every_single_byte_change() -> None:
    data = bytearray(torch.randint(0, 256, (4 * 4096 + 40,), dtype=torch.uint8).tolist())
    good = checksum(bytes(data))
    for pos in range(len(data)):
        for delta in (1, 0x80, 0xFF):
            data[pos] ^= delta
            assert checksum(bytes(data)) != good, (pos, delta)
            data[pos] ^= delta


def test_checksum_sees_swapped_words_and_blocks() -> None:
    data = bytes(torch.randint(0, 256, (8 * 4096,), dtype=torch.uint8).tolist())
    words = np.frombuffer(data, dtype=np.uint32).copy()
    words[[3, 4100]] = words[[4100, 3]]
    assert checksum(words) != checksum(data)
    half = len(data) // 2
    assert checksum(data[half:] + data[:half]) != checksum(data)


# -- framing: the KVChunk message by hand -------------------------------------------------


@pytest.mark.parametrize("data_len", [1, 127, 128, 300, 1 << 20])
def test_frames_are_kvchunk_messages(data_len: int) -> None:
    header, data = b"h" * 120, bytes(range(256)) * (data_len // 256) + b"x" * (data_len % 256)
    frame = encode_frame(header, data)
    assert frame == pb.KVChunk(header=header, data=data).SerializeToString()
    msg = pb.KVChunk.FromString(frame)
    assert (msg.header, msg.data) == (header, data)
    got_header, got_data = decode_frame(frame)
    assert got_header == header and bytes(got_data) == data
    array = np.frombuffer(data, dtype=np.uint8)
    assert encode_frame(header, array) == frame


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x0a",
        b"\x0a\x03abc",  # no data field
        b"\x12\x01x\x0a\x01h",  # fields out of order
        b"\x0a\x00\x12\x01x",  # empty header
        b"\x0a\x01h\x12\x00",  # empty data
        b"\x0a\x01h\x12\x02x",  # data shorter than its length
        b"\x0a\x01h\x12\x01xy",  # trailing bytes
        b"\x0a\x01h\x1a\x01x",  # unknown field 3
        b"\x0a\xff\xff\xff\xff\xff\xff\x01h",  # oversized varint
        b"\x0a\x01h\x12\xff\xff\xff\xff\x0fx",  # length far past the end
    ],
)
def test_malformed_frames_are_refused(frame: bytes) -> None:
    with pytest.raises(InvalidArgument):
        decode_frame(frame)


def test_framed_chunks_round_trip_through_the_assembler() -> None:
    k, v = kv()
    asm = ChunkAssembler(LAYOUT, NUM_BLOCKS, NUM_TOKENS, max_blocks=NUM_BLOCKS)
    for header, data in encode_chunks(k, v, 2 * UNIT):
        asm.add(*decode_frame(encode_frame(header, data)))
    out = asm.finish()
    assert torch.equal(out.k, k) and torch.equal(out.v, v)


# -- gathering chunks out of a paged pool -------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("max_chunk_bytes", [UNIT, 3 * UNIT, 1 << 20])
def test_gather_chunks_reads_the_named_blocks_of_a_pool(dtype: str, max_chunk_bytes: int) -> None:
    layout = replace(LAYOUT, dtype=dtype)
    pool_k, pool_v = kv(layout, num_blocks=12, seed=3)
    block_ids = [7, 2, 11, 3, 0]
    ranges = chunk_ranges(layout.num_layers, len(block_ids), unit_bytes(layout), max_chunk_bytes)
    want_k, want_v = pool_k[:, block_ids], pool_v[:, block_ids]
    asm = ChunkAssembler(layout, NUM_BLOCKS, NUM_TOKENS, max_blocks=NUM_BLOCKS)
    for r, data in zip(ranges, gather_chunks(pool_k, pool_v, block_ids, ranges), strict=True):
        assert data.flags.c_contiguous and data.nbytes <= max_chunk_bytes
        header = encode_chunks(
            want_k[r.layer_start : r.layer_end, r.block_start : r.block_end],
            want_v[r.layer_start : r.layer_end, r.block_start : r.block_end],
            max_chunk_bytes,
        )
        (h, d), *_ = header
        assert bytes(d) == data.tobytes()
        asm.add(msgpack.packb({**msgpack.unpackb(h), **r._asdict()}), memoryview(data).cast("B"))
    out = asm.finish()
    assert torch.equal(out.k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(out.v.view(torch.uint8), want_v.view(torch.uint8))


def test_gather_chunks_refuses_block_ids_outside_the_pool() -> None:
    pool_k, pool_v = kv(num_blocks=4)
    ranges = chunk_ranges(LAYOUT.num_layers, 2, UNIT, 1 << 20)
    for block_ids in ([0, 4], [-1, 0]):
        with pytest.raises(InvalidArgument):
            gather_chunks(pool_k, pool_v, block_ids, ranges)
