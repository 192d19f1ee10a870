"""The chunk format of the `grpc` KV transport: raw tensor bytes under a small msgpack header.

A chunk carries the keys and values of a range of layers x a range of blocks (block indexes
into the handle's block list, not block ids) as one C-contiguous little-endian tensor
`[layers, 2 (key, value), blocks, block_size, num_kv_heads, head_dim]`. Its header is a msgpack
map with exactly the keys of `HEADER_KEYS` (see `KVChunk` in kv_transfer.proto); its checksum
is `checksum(data)`.

On the wire a chunk is a `KVChunk` message, encoded and parsed here (`encode_frame`,
`decode_frame`) rather than by protobuf, which would copy the data twice more on each side.

The receiver trusts nothing: `ChunkAssembler` sizes its buffers from its own layout and the
handle, and checks every header field, the byte length and the checksum of a chunk before
copying it, so a malformed or hostile stream cannot make it allocate or write out of bounds.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import msgpack
import numpy as np
import torch

from cluster.engine.kv_cache import KVExport, KVLayout
from cluster.errors import FailedPrecondition, InvalidArgument

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
HEADER_KEYS = frozenset(
    ("layer_start", "layer_end", "block_start", "block_end", "dtype", "shape", "nbytes", "checksum")
)
_INT_KEYS = HEADER_KEYS - {"dtype", "shape"}
MAX_HEADER_BYTES = 512  # a real header is ~120 bytes
# gRPC message limits of both ends, beside max_chunk_bytes:
HEADER_SLACK = 4096  # room for the chunk header and protobuf framing above max_chunk_bytes
MAX_REQUEST_BYTES = 4 << 20  # a FetchKV or PushKV request carries a handle: ~5 bytes per block id


class ChunkRange(NamedTuple):
    """The (layer, block) rectangle one chunk covers: layers [layer_start, layer_end) x block
    indexes [block_start, block_end)."""

    layer_start: int
    layer_end: int
    block_start: int
    block_end: int


def unit_bytes(layout: KVLayout) -> int:
    """Bytes of one block of one layer, keys and values: the smallest chunk there is."""
    if layout.dtype not in DTYPES:
        raise FailedPrecondition(f"KV dtype {layout.dtype!r} is not one of {sorted(DTYPES)}")
    itemsize = DTYPES[layout.dtype].itemsize
    return 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * itemsize


def chunk_ranges(
    num_layers: int, num_blocks: int, unit: int, max_chunk_bytes: int
) -> list[ChunkRange]:
    """Cut `num_layers` x `num_blocks` units of `unit` bytes into chunks of at most
    `max_chunk_bytes`: whole layers per chunk when a layer fits, else runs of blocks of one
    layer. InvalidArgument if one unit is bigger than `max_chunk_bytes`."""
    if unit > max_chunk_bytes:
        raise InvalidArgument(
            f"one block of one layer is {unit} bytes, over max_chunk_bytes={max_chunk_bytes}"
        )
    layer_bytes = unit * num_blocks
    if layer_bytes <= max_chunk_bytes:
        step = max_chunk_bytes // layer_bytes
        return [
            ChunkRange(l0, min(l0 + step, num_layers), 0, num_blocks)
            for l0 in range(0, num_layers, step)
        ]
    step = max_chunk_bytes // unit
    return [
        ChunkRange(layer, layer + 1, b0, min(b0 + step, num_blocks))
        for layer in range(num_layers)
        for b0 in range(0, num_blocks, step)
    ]


def gather_chunks(
    k: torch.Tensor, v: torch.Tensor, block_ids: Sequence[int], ranges: Sequence[ChunkRange]
) -> list[np.ndarray]:
    """The data of each chunk of `ranges`, copied out of `k` and `v` (`[layers, pool blocks,
    block_size, kv_heads, head_dim]`, e.g. a paged pool) at blocks `block_ids`: host arrays
    `[layers, 2, blocks, block_size, kv_heads, head_dim]` of the integer type of the KV's width,
    C-contiguous, each the chunk's wire bytes. One copy per byte on a CPU pool; a GPU pool is
    gathered on the GPU and crosses to the host once."""
    _check_byteorder()
    if k.dim() != 5 or k.shape != v.shape or k.dtype != v.dtype or k.dtype not in _DTYPE_NAMES:
        raise InvalidArgument(f"cannot encode KV of shapes {tuple(k.shape)} / {tuple(v.shape)}")
    shapes = [
        (r.layer_end - r.layer_start, 2, r.block_end - r.block_start, *k.shape[2:]) for r in ranges
    ]
    if any(not 0 <= b < k.shape[1] for b in block_ids):
        raise InvalidArgument(f"block ids out of range for a pool of {k.shape[1]} blocks")
    ends = np.cumsum([int(np.prod(shape)) for shape in shapes]).tolist()
    starts = [0, *ends[:-1]]
    if k.device.type != "cpu":
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=k.device)
        parts = [
            torch.stack(
                [
                    t[r.layer_start : r.layer_end].index_select(1, idx[r.block_start : r.block_end])
                    for t in (k, v)
                ],
                dim=1,
            ).flatten()
            for r in ranges
        ]
        flat = _host_array(torch.cat(parts))  # one device-to-host copy
        return [flat[a:b].reshape(s) for a, b, s in zip(starts, ends, shapes, strict=True)]
    # numpy, not torch: torch's CPU index_select into a view is ~50x slower here. One buffer
    # for all chunks, allocated by numpy, which asks for huge pages: first-touch page faults on
    # a few-MiB allocation each cost more than the copy into it.
    src = (_host_array(k), _host_array(v))
    ids = np.asarray(block_ids, dtype=np.intp)
    flat = np.empty(ends[-1] if ends else 0, dtype=src[0].dtype)
    out = [flat[a:b].reshape(s) for a, b, s in zip(starts, ends, shapes, strict=True)]
    for r, dst in zip(ranges, out, strict=True):
        run = ids[r.block_start : r.block_end]
        for i, layer in enumerate(range(r.layer_start, r.layer_end)):
            for kv in (0, 1):
                # mode="clip": "raise" would buffer `out`; the ids were checked above.
                np.take(src[kv][layer], run, axis=0, out=dst[i, kv], mode="clip")
    return out


def chunk_header(r: ChunkRange, data: np.ndarray, dtype: str) -> bytes:
    """The msgpack header of the chunk `r` whose wire bytes are `data` (from `gather_chunks`)."""
    header = {
        "layer_start": r.layer_start,
        "layer_end": r.layer_end,
        "block_start": r.block_start,
        "block_end": r.block_end,
        "dtype": dtype,
        "shape": list(data.shape),
        "nbytes": data.nbytes,
        "checksum": checksum(data),
    }
    return msgpack.packb(header)


def encode_chunks(
    k: torch.Tensor, v: torch.Tensor, max_chunk_bytes: int, *, layer_offset: int = 0
) -> Iterator[tuple[bytes, memoryview]]:
    """`k` and `v` (`[layers, blocks, block_size, kv_heads, head_dim]`) as (header, data)
    chunks of at most `max_chunk_bytes` data each (see `chunk_ranges`). `layer_offset` is added
    to the layer numbers in the headers (for tensors holding a slice of the layers)."""
    if k.dim() != 5 or k.dtype not in _DTYPE_NAMES:
        raise InvalidArgument(f"cannot encode KV of shape {tuple(k.shape)} and {k.dtype}")
    num_layers, num_blocks = k.shape[:2]
    unit = 2 * k[0, 0].numel() * k.element_size() if k.numel() else 0
    if unit == 0:
        return
    ranges = chunk_ranges(num_layers, num_blocks, unit, max_chunk_bytes)
    for r, data in zip(ranges, gather_chunks(k, v, range(num_blocks), ranges), strict=True):
        shifted = r._replace(
            layer_start=r.layer_start + layer_offset, layer_end=r.layer_end + layer_offset
        )
        yield chunk_header(shifted, data, _DTYPE_NAMES[k.dtype]), memoryview(data).cast("B")


class ChunkAssembler:
    """Rebuilds a `KVExport` from the chunks of one fetch, against the receiver's own layout.

    `num_blocks` and `num_tokens` come from the handle; `max_blocks` is the caller's cap (e.g.
    its pool size), checked before anything is allocated. `add` raises FailedPrecondition when
    a chunk disagrees with the layout (dtype, shape) and InvalidArgument when it is malformed;
    either way nothing of that chunk has been copied."""

    def __init__(self, layout: KVLayout, num_blocks: int, num_tokens: int, max_blocks: int) -> None:
        _check_byteorder()
        self.unit_bytes = unit_bytes(layout)
        for name, x in (("num_blocks", num_blocks), ("num_tokens", num_tokens)):
            if type(x) is not int or x <= 0:
                raise InvalidArgument(f"KV {name} must be a positive int, got {x!r}")
        if num_blocks != -(-num_tokens // layout.block_size):
            raise InvalidArgument(
                f"{num_blocks} KV blocks cannot hold exactly {num_tokens} tokens "
                f"of block size {layout.block_size}"
            )
        if num_blocks > max_blocks:
            raise InvalidArgument(f"KV of {num_blocks} blocks is over the cap of {max_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.num_tokens = num_tokens
        self.dtype = DTYPES[layout.dtype]
        shape = (layout.num_layers, num_blocks, *layout.block_shape)
        # Allocated by numpy, which asks for huge pages: first-touch page faults on a fresh
        # torch.empty cost more than the copy into it (47 MB: 30 ms against 12 ms).
        raw = _RAW_INT[self.dtype.itemsize]
        self._k_np, self._v_np = np.empty(shape, dtype=raw), np.empty(shape, dtype=raw)
        self.k = torch.from_numpy(self._k_np).view(self.dtype)  # views: writes land in both
        self.v = torch.from_numpy(self._v_np).view(self.dtype)
        self._covered = torch.zeros((layout.num_layers, num_blocks), dtype=torch.bool)
        self.bytes_received = 0
        self._finished = False

    def add(self, header: bytes, data: bytes | memoryview) -> None:
        """Validate one chunk completely, then copy it into place."""
        if self._finished:
            raise InvalidArgument("KV chunk after the stream was finished")
        h = _decode_header(header)
        l0, l1, b0, b1 = h["layer_start"], h["layer_end"], h["block_start"], h["block_end"]
        if not (0 <= l0 < l1 <= self.layout.num_layers and 0 <= b0 < b1 <= self.num_blocks):
            raise InvalidArgument(
                f"KV chunk covers layers [{l0}, {l1}) x blocks [{b0}, {b1}), outside "
                f"[0, {self.layout.num_layers}) x [0, {self.num_blocks})"
            )
        if h["dtype"] != self.layout.dtype:
            raise FailedPrecondition(f"KV chunk dtype {h['dtype']!r} != {self.layout.dtype!r}")
        shape = [l1 - l0, 2, b1 - b0, *self.layout.block_shape]
        if h["shape"] != shape:
            raise FailedPrecondition(f"KV chunk shape {h['shape']} != expected {shape}")
        nbytes = (l1 - l0) * (b1 - b0) * self.unit_bytes
        if h["nbytes"] != nbytes or len(data) != nbytes:
            raise InvalidArgument(
                f"KV chunk of shape {shape} needs {nbytes} bytes; header says {h['nbytes']}, "
                f"got {len(data)}"
            )
        if bool(self._covered[l0:l1, b0:b1].any()):
            raise InvalidArgument(f"KV chunk layers [{l0}, {l1}) x blocks [{b0}, {b1}) repeats")
        piece = np.frombuffer(data, dtype=self._k_np.dtype).reshape(shape)
        if checksum(piece) != h["checksum"]:
            raise InvalidArgument("KV chunk checksum mismatch")
        self._k_np[l0:l1, b0:b1] = piece[:, 0]
        self._v_np[l0:l1, b0:b1] = piece[:, 1]
        self._covered[l0:l1, b0:b1] = True
        self.bytes_received += nbytes

    def finish(self) -> KVExport:
        """The assembled KV; InvalidArgument unless every (layer, block) arrived exactly once."""
        missing = int((~self._covered).sum())
        if missing:
            raise InvalidArgument(
                f"KV stream ended with {missing} of {self._covered.numel()} (layer, block) "
                "pieces missing"
            )
        self._finished = True
        return KVExport(self.layout, self.num_tokens, self.k, self.v)


def _decode_header(raw: bytes) -> dict:
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_HEADER_BYTES:
        raise InvalidArgument("KV chunk header is not bytes or is too long")
    try:
        h = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_bin_len=0,
            max_str_len=32,
            max_array_len=8,
            max_map_len=len(HEADER_KEYS),
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise InvalidArgument(f"KV chunk header is not valid msgpack: {exc}") from None
    if not isinstance(h, dict) or set(h) != HEADER_KEYS:
        keys = sorted(map(str, h)) if isinstance(h, dict) else type(h).__name__
        raise InvalidArgument(f"KV chunk header must be a map of {sorted(HEADER_KEYS)}: {keys}")
    if not all(type(h[key]) is int for key in _INT_KEYS):
        raise InvalidArgument("KV chunk header: ranges, nbytes and checksum must be ints")
    if type(h["dtype"]) is not str:
        raise InvalidArgument("KV chunk header: dtype must be a string")
    shape = h["shape"]
    if type(shape) is not list or not all(type(d) is int for d in shape):
        raise InvalidArgument("KV chunk header: shape must be a list of ints")
    return h


def _host_array(t: torch.Tensor) -> np.ndarray:
    """`t`'s bytes as a C-contiguous host numpy array of the integer type of the same width (a
    view when `t` is a contiguous CPU tensor, so writes land in `t`). KV only moves here, never
    computes; numpy has no bfloat16, and its single-threaded copies beat torch's CPU copy
    kernels on these sizes (bfloat16 copies by ~100x, measured with torch 2.13)."""
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().cpu().contiguous().view(raw).numpy()


_RAW_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _check_byteorder() -> None:
    if sys.byteorder != "little":
        raise FailedPrecondition("the KV wire format is little-endian; this host is not")


# -- framing: a KVChunk message, by hand ---------------------------------------------------

_HEADER_TAG = b"\x0a"  # KVChunk field 1 (header), wire type 2 (length-delimited)
_DATA_TAG = b"\x12"  # KVChunk field 2 (data), wire type 2


def encode_frame(header: bytes, data: np.ndarray | memoryview | bytes) -> bytes:
    """The `KVChunk(header=header, data=data)` message in protobuf wire form, as
    `SerializeToString` writes it, with a single copy of `data`."""
    view = memoryview(data).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
    return b"".join(
        (_HEADER_TAG, _varint(len(header)), header, _DATA_TAG, _varint(view.nbytes), view)
    )


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


# -- checksum ------------------------------------------------------------------------------

_ROW_WORDS = 4096  # row length of the 2-D reductions; the checksum does not depend on it
_COL_WEIGHTS = np.arange(1, _ROW_WORDS + 1, dtype=np.uint64)
_M32 = 0xFFFFFFFF


def checksum(data: np.ndarray | memoryview | bytes) -> int:
    """Fletcher-64-style checksum of `data`, computed with numpy at memory speed (~10 GB/s;
    zlib.crc32 runs at ~1.6 GB/s and was a third of a fetch's CPU time).

    With w_0..w_{n-1} the little-endian 32-bit words of `data` (a trailing partial word padded
    with zero bytes), A = sum(w_i) mod 2^32 and B = sum((i + 1) * w_i) mod 2^32; the checksum is
    B << 32 | A. Any change confined to one word (a flipped byte or bit, a burst of up to 4
    bytes) changes A. Swapped or misplaced words change B unless (j - i) * (w_i - w_j) is
    divisible by 2^32. Trailing zero bytes are not seen (padding), so the byte length is
    checked separately, as `ChunkAssembler` does with the header's `nbytes`.

    B is computed without a weight array: with the words as rows of `_ROW_WORDS` (R), word
    r*R + c weighs r*R + (c + 1), so B = R * sum(r * rowsum_r) + sum((c + 1) * colsum_c)."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    raw = raw.reshape(-1).view(np.uint8)
    n_full, tail = divmod(raw.size, 4)
    words = raw[: 4 * n_full].view("<u4")
    if tail:
        last = np.zeros(4, dtype=np.uint8)
        last[:tail] = raw[4 * n_full :]
        words = np.concatenate((words, last.view("<u4")))
    rows = words.size // _ROW_WORDS
    grid = words[: rows * _ROW_WORDS].reshape(rows, _ROW_WORDS)
    rest = words[rows * _ROW_WORDS :].astype(np.uint64)
    # uint32 sums wrap mod 2^32, uint64 ones mod 2^64: both agree mod 2^32, all that is kept.
    row_sums = grid.sum(axis=1, dtype=np.uint32).astype(np.uint64)
    col_sums = grid.sum(axis=0, dtype=np.uint32).astype(np.uint64)
    r_weights = np.arange(rows, dtype=np.uint64)
    t_weights = np.arange(1, rest.size + 1, dtype=np.uint64)
    a = int(row_sums.sum(dtype=np.uint64)) + int(rest.sum(dtype=np.uint64))
    b = (
        _ROW_WORDS * int((r_weights * row_sums).sum(dtype=np.uint64))
        + int((_COL_WEIGHTS * col_sums).sum(dtype=np.uint64))
        + rows * _ROW_WORDS * int(rest.sum(dtype=np.uint64))
        + int((t_weights * rest).sum(dtype=np.uint64))
    )
    return (b & _M32) << 32 | (a & _M32)
