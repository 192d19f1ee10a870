from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import replace

import msgpack
import pytest
import torch

from cluster.errors import FailedPrecondition, InvalidArgument
from cluster.kv_cache import KVLayout
from cluster.kv_wire import MAX_HEADER_BYTES, ChunkAssembler, encode_chunks, unit_bytes

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
    return list(encode_chunks(k, v, max_chunk_bytes))


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
        "checksum": zlib.crc32(data),
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
    return zlib.crc32(data)


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
