"""A `KVChunk` message framed by hand: `encode_frame` writes what protobuf's `SerializeToString`
would, `decode_frame` reads only that form, without the two extra copies of the chunk data
protobuf would make on each side (see `kv_wire` for the chunk format)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cluster.errors import InvalidArgument

_HEADER_TAG = b"\x0a"  # KVChunk field 1 (header), wire type 2 (length-delimited)
_DATA_TAG = b"\x12"  # KVChunk field 2 (data), wire type 2


def encode_frame(
    header: bytes, data: np.ndarray | memoryview | bytes | Sequence[memoryview]
) -> bytes:
    """The `KVChunk(header=header, data=data)` message in protobuf wire form, as
    `SerializeToString` writes it, with a single copy of `data`; a sequence of byte views is
    the data in pieces (e.g. straight out of a pool), copied once each."""
    if isinstance(data, (list, tuple)):
        pieces = [memoryview(piece) for piece in data]
    else:
        pieces = [memoryview(data).cast("B") if isinstance(data, np.ndarray) else memoryview(data)]
    nbytes = sum(piece.nbytes for piece in pieces)
    prefix = (_HEADER_TAG, _varint(len(header)), header, _DATA_TAG, _varint(nbytes))
    return b"".join((*prefix, *pieces))


def decode_frame(raw: bytes) -> tuple[bytes, memoryview]:
    """(header, data) of a `KVChunk` in wire form, data as a view into `raw`. Only the form
    `encode_frame` writes is accepted: both fields, non-empty, once each, in order."""
    view = memoryview(raw)
    pos = 0
    fields = []
    for tag in (_HEADER_TAG, _DATA_TAG):
        if view[pos : pos + 1] != tag:
            raise InvalidArgument("KV chunk is not a KVChunk(header, data) message")
        length, pos = _read_varint(view, pos + 1)
        if not 0 < length <= len(view) - pos:
            raise InvalidArgument("KV chunk field length is zero or past the end of the message")
        fields.append(view[pos : pos + length])
        pos += length
    if pos != len(view):
        raise InvalidArgument("KV chunk has bytes after its data")
    header, data = fields
    return bytes(header), data


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(0x80 | (n & 0x7F))
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    n = shift = 0
    for i in range(pos, min(pos + 5, len(view))):  # 5 bytes hold any length under 2^35
        n |= (view[i] & 0x7F) << shift
        if not view[i] & 0x80:
            return n, i + 1
        shift += 7
    raise InvalidArgument("KV chunk has a malformed or oversized length")
