"""The chunk format of the `grpc` KV transport: raw tensor bytes under a small msgpack header.

A chunk carries the keys and values of a range of layers x a range of blocks (block indexes
into the handle's block list, not block ids) as one C-contiguous little-endian tensor
`[layers, 2 (key, value), blocks, block_size, num_kv_heads, head_dim]`. Its header is a msgpack
map with exactly the keys of `HEADER_KEYS` (see `KVChunk` in kv_transfer.proto).

The receiver trusts nothing: `ChunkAssembler` sizes its buffers from its own layout and the
handle, and checks every header field, the byte length and the checksum of a chunk before
copying it, so a malformed or hostile stream cannot make it allocate or write out of bounds.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Iterator

import msgpack
import numpy as np
import torch

from cluster.errors import FailedPrecondition, InvalidArgument
from cluster.kv_cache import KVExport, KVLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
HEADER_KEYS = frozenset(
    ("layer_start", "layer_end", "block_start", "block_end", "dtype", "shape", "nbytes", "checksum")
)
_INT_KEYS = HEADER_KEYS - {"dtype", "shape"}
MAX_HEADER_BYTES = 512  # a real header is ~120 bytes


def unit_bytes(layout: KVLayout) -> int:
    """Bytes of one block of one layer, keys and values: the smallest chunk there is."""
    if layout.dtype not in DTYPES:
        raise FailedPrecondition(f"KV dtype {layout.dtype!r} is not one of {sorted(DTYPES)}")
    itemsize = DTYPES[layout.dtype].itemsize
    return 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * itemsize


def encode_chunks(
    k: torch.Tensor, v: torch.Tensor, max_chunk_bytes: int, *, layer_offset: int = 0
) -> Iterator[tuple[bytes, bytes]]:
    """Cut `k` and `v` (`[layers, blocks, block_size, kv_heads, head_dim]`) into chunks of at
    most `max_chunk_bytes` data each: whole layers per chunk when a layer fits, else runs of
    blocks of one layer. `layer_offset` is added to the layer numbers in the headers (for
    tensors holding a slice of the layers). Raises InvalidArgument if one block of one layer
    is bigger than `max_chunk_bytes`."""
    _check_byteorder()
    if k.dim() != 5 or k.shape != v.shape or k.dtype != v.dtype or k.dtype not in _DTYPE_NAMES:
        raise InvalidArgument(f"cannot encode KV of shapes {tuple(k.shape)} / {tuple(v.shape)}")
    num_layers, num_blocks = k.shape[:2]
    unit = 2 * k[0, 0].numel() * k.element_size() if k.numel() else 0
    if unit == 0:
        return
    if unit > max_chunk_bytes:
        raise InvalidArgument(
            f"one block of one layer is {unit} bytes, over max_chunk_bytes={max_chunk_bytes}"
        )
    layer_bytes = unit * num_blocks
    if layer_bytes <= max_chunk_bytes:
        step = max_chunk_bytes // layer_bytes
        ranges = [
            (l0, min(l0 + step, num_layers), 0, num_blocks) for l0 in range(0, num_layers, step)
        ]
    else:
        step = max_chunk_bytes // unit
        ranges = [
            (layer, layer + 1, b0, min(b0 + step, num_blocks))
            for layer in range(num_layers)
            for b0 in range(0, num_blocks, step)
        ]
    k_np, v_np = _host_array(k), _host_array(v)
    for l0, l1, b0, b1 in ranges:
        # [layers, 2, blocks, block_size, kv_heads, head_dim]: per layer, its K run then its V
        # run, each contiguous in the source, so the chunk is built with a single copy.
        data = b"".join(a[layer, b0:b1].data for layer in range(l0, l1) for a in (k_np, v_np))
        shape = [l1 - l0, 2, b1 - b0, *k.shape[2:]]
        header = {
            "layer_start": l0 + layer_offset,
            "layer_end": l1 + layer_offset,
            "block_start": b0,
            "block_end": b1,
            "dtype": _DTYPE_NAMES[k.dtype],
            "shape": shape,
            "nbytes": len(data),
            "checksum": zlib.crc32(data),
        }
        yield msgpack.packb(header), data


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
        self.k = torch.empty(shape, dtype=self.dtype)
        self.v = torch.empty(shape, dtype=self.dtype)
        self._k_np, self._v_np = _host_array(self.k), _host_array(self.v)  # views, not copies
        self._covered = torch.zeros((layout.num_layers, num_blocks), dtype=torch.bool)
        self.bytes_received = 0
        self._finished = False

    def add(self, header: bytes, data: bytes) -> None:
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
        if zlib.crc32(data) != h["checksum"]:
            raise InvalidArgument("KV chunk checksum mismatch")
        piece = np.frombuffer(data, dtype=self._k_np.dtype).reshape(shape)
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


def _check_byteorder() -> None:
    if sys.byteorder != "little":
        raise FailedPrecondition("the KV wire format is little-endian; this host is not")
