"""The chunk format of the `grpc` KV transport: raw tensor bytes under a small msgpack header.

A chunk carries the keys and values of a range of layers x a range of blocks (block indexes
into the handle's block list, not block ids) as one C-contiguous little-endian tensor
`[layers, 2 (key, value), blocks, block_size, num_kv_heads, head_dim]`. Its header is a msgpack
map with exactly the keys of `HEADER_KEYS` (see `KVChunk` in kv_transfer.proto); its checksum
is `checksum(data)`.

On the wire a chunk is a `KVChunk` message, encoded and parsed by `kv_frame` rather than by
protobuf, which would copy the data twice more on each side.

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
from cluster.kv_transfer.kv_checksum import checksum

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
    # numpy, not torch: torch's CPU index_select into a view is far slower here. One buffer
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


def chunk_header(
    r: ChunkRange, data: np.ndarray | PoolSlices, dtype: str, with_checksum: bool = True
) -> bytes:
    """The msgpack header of the chunk `r` whose wire bytes are `data` (from `gather_chunks`
    or `pool_slices`); its checksum is 0 unless `with_checksum` (one more pass over the data;
    gathered data only)."""
    if with_checksum and not isinstance(data, np.ndarray):
        raise InvalidArgument("a chunk checksum needs the chunk's data gathered")
    header = {
        "layer_start": r.layer_start,
        "layer_end": r.layer_end,
        "block_start": r.block_start,
        "block_end": r.block_end,
        "dtype": dtype,
        "shape": list(data.shape),
        "nbytes": data.nbytes,
        "checksum": checksum(data) if with_checksum else 0,
    }
    return msgpack.packb(header)


class PoolSlices(NamedTuple):
    """A chunk's wire bytes still in a host pool: one view per (layer, keys or values)."""

    shape: tuple[int, ...]
    nbytes: int
    pieces: list[memoryview]


def pool_slices(
    k: torch.Tensor, v: torch.Tensor, block_ids: Sequence[int], r: ChunkRange
) -> PoolSlices | None:
    """Chunk `r` of the blocks `block_ids` of a contiguous host pool as views into it, when
    its blocks are consecutive in the pool (as a fresh pool hands them out): framing then
    copies each byte once, straight from the pool. None otherwise (gather them)."""
    ids = list(block_ids[r.block_start : r.block_end])
    if k.device.type != "cpu" or not (k.is_contiguous() and v.is_contiguous()):
        return None
    if ids != list(range(ids[0], ids[0] + len(ids))) or ids[-1] >= k.shape[1]:
        return None
    src = (_host_array(k), _host_array(v))
    end = ids[0] + len(ids)
    pieces = [
        memoryview(src[kv][layer, ids[0] : end]).cast("B")
        for layer in range(r.layer_start, r.layer_end)
        for kv in (0, 1)
    ]
    shape = (r.layer_end - r.layer_start, 2, len(ids), *k.shape[2:])
    return PoolSlices(shape, sum(p.nbytes for p in pieces), pieces)


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
    either way nothing of that chunk has been copied. With `verify_checksum` it also checks
    each chunk's checksum (the sender was asked for them). With `into` = (k, v, block ids) of
    a host pool (`[layers, pool blocks, ...]`, contiguous) each chunk is copied straight into
    those blocks of the pool (token order) instead of new tensors: one copy on this side."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        num_tokens: int,
        max_blocks: int,
        *,
        verify_checksum: bool = True,
        into: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None,
    ) -> None:
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
        self.verify_checksum = verify_checksum
        self._targets: np.ndarray | None = None
        if into is not None:
            self.k, self.v, ids = into
            self._k_np, self._v_np = _pool_views(self.k, self.v, layout, num_blocks, ids)
            self._targets = np.asarray(ids, dtype=np.intp)
        else:
            shape = (layout.num_layers, num_blocks, *layout.block_shape)
            # Allocated by numpy, which asks for huge pages: first-touch page faults on a fresh
            # torch.empty cost more than the copy into it.
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
        if self.verify_checksum and checksum(piece) != h["checksum"]:
            raise InvalidArgument("KV chunk checksum mismatch")
        blocks = self._blocks(b0, b1)
        self._k_np[l0:l1, blocks] = piece[:, 0]
        self._v_np[l0:l1, blocks] = piece[:, 1]
        self._covered[l0:l1, b0:b1] = True
        self.bytes_received += nbytes

    def finish(self) -> KVExport:
        """The assembled KV; InvalidArgument unless every (layer, block) arrived exactly once.
        With `into`, the KV is in the pool's blocks and `k`, `v` are the whole pool."""
        missing = int((~self._covered).sum())
        if missing:
            raise InvalidArgument(
                f"KV stream ended with {missing} of {self._covered.numel()} (layer, block) "
                "pieces missing"
            )
        self._finished = True
        return KVExport(self.layout, self.num_tokens, self.k, self.v)

    def _blocks(self, b0: int, b1: int) -> slice | np.ndarray:
        """Where block indexes [b0, b1) of the handle land: a slice when they are contiguous
        (a plain copy), else the pool's block ids (a scatter)."""
        if self._targets is None:
            return slice(b0, b1)
        ids = self._targets[b0:b1]
        if ids[-1] - ids[0] == b1 - b0 - 1 and bool(np.all(np.diff(ids) == 1)):
            return slice(int(ids[0]), int(ids[-1]) + 1)
        return ids


def _pool_views(
    k: torch.Tensor, v: torch.Tensor, layout: KVLayout, num_blocks: int, ids: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Writable numpy views of a host pool that an assembler may fill at blocks `ids`."""
    shape = (layout.num_layers, k.shape[1] if k.dim() == 5 else -1, *layout.block_shape)
    if k.dim() != 5 or tuple(k.shape) != shape or k.shape != v.shape:
        raise InvalidArgument(f"KV pool of shape {tuple(k.shape)} is not {shape}")
    if k.device.type != "cpu" or not (k.is_contiguous() and v.is_contiguous()):
        raise InvalidArgument("KV chunks are assembled into a contiguous host pool only")
    if k.dtype != DTYPES[layout.dtype] or v.dtype != k.dtype:
        raise FailedPrecondition(f"KV pool dtype {k.dtype} is not {layout.dtype}")
    if len(ids) != num_blocks or not all(0 <= b < k.shape[1] for b in ids):
        raise InvalidArgument(f"{len(ids)} pool blocks for {num_blocks} KV blocks, or out of range")
    return _host_array(k), _host_array(v)


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
