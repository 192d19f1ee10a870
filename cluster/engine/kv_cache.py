"""The paged KV pool of one engine, and the layout fingerprint two pools must share.

Shape of each per-layer tensor: `[num_blocks, block_size, num_kv_heads, head_dim]`, one for keys
and one for values. Block `b` of every layer together holds the K/V of `block_size` consecutive
tokens of whichever sequence owns block `b` (see `BlockManager` for ownership).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from cluster.config import CacheConfig
from cluster.errors import FailedPrecondition, InvalidArgument

# The pool of a CPU engine given neither `num_blocks` nor `kv_cache_memory`.
CPU_KV_BLOCKS = 1024
_GiB = 1 << 30


@dataclass(frozen=True)
class KVLayout:
    """Everything that must match for KV written by one engine to be read by another.

    A pool of a tensor-parallel rank holds a slice of the model's KV heads: `num_kv_heads`
    heads from `kv_head_start`, of `total_kv_heads`, in a replica of `tp_size` ranks (at TP 1:
    all of them, from 0). A head slice of a pool (`head_slice`) is what one rank of another TP
    size reads from it."""

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_head_start: int = 0
    total_kv_heads: int = 0  # 0: num_kv_heads (a whole pool)
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.total_kv_heads:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if not self.tp_size:
            object.__setattr__(self, "tp_size", 1)

    def to_dict(self) -> dict:
        return dict(vars(self))  # its fields, all flat (asdict's deep copy took 20x as long)

    @property
    def head_end(self) -> int:
        return self.kv_head_start + self.num_kv_heads

    def same_model(self, other: KVLayout) -> bool:
        """Whether KV heads of `other` and of this layout are the same heads of the same
        model's KV, whatever slice of them each holds."""
        fixed = ("model_id", "dtype", "num_layers", "head_dim", "block_size", "total_kv_heads")
        return all(getattr(self, f) == getattr(other, f) for f in fixed)

    def head_slice(self, start: int, count: int) -> KVLayout:
        """The layout of heads `[start, start + count)` of this pool's (FailedPrecondition if
        it does not hold them all)."""
        if not self.kv_head_start <= start < start + count <= self.head_end:
            raise FailedPrecondition(
                f"KV heads [{start}, {start + count}) are not in this pool's "
                f"[{self.kv_head_start}, {self.head_end})"
            )
        return replace(self, kv_head_start=start, num_kv_heads=count)

    def check_serves(self, slice_layout: KVLayout) -> int:
        """Check that `slice_layout` is a head slice of this layout; its first head's index in
        this pool. FailedPrecondition otherwise (at TP 1 on both sides: unless equal)."""
        start, count = slice_layout.kv_head_start, slice_layout.num_kv_heads
        if count < 1 or not self.kv_head_start <= start <= self.head_end - count:
            self.check_matches(slice_layout)  # raises, naming the fields that differ
        self.head_slice(start, count).check_matches(slice_layout)
        return start - self.kv_head_start

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes in the pool: keys and values of every layer."""
        itemsize = getattr(torch, self.dtype).itemsize
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def check_matches(self, other: KVLayout) -> None:
        if self != other:
            diff = {
                k: (v, getattr(other, k)) for k, v in asdict(self).items() if getattr(other, k) != v
            }
            raise FailedPrecondition(f"KV layout mismatch (ours, theirs): {diff}")


@dataclass(frozen=True)
class KVExport:
    """The KV of one sequence's first `num_tokens` tokens, lifted out of a pool.
    `k` and `v` are `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`."""

    layout: KVLayout
    num_tokens: int
    k: torch.Tensor
    v: torch.Tensor


def kv_pool_blocks(
    cache: CacheConfig,
    block_bytes: int,
    device: torch.device,
    reserve_bytes: int,
    memory: tuple[int, int] | None = None,
) -> int:
    """How many blocks the KV pool of an engine on `device` gets, its weights already loaded:
    `cache.num_blocks` if given; else `kv_cache_memory` bytes' worth; else, on a GPU, what
    `gpu_memory_utilization` of its memory leaves after everything in use now (the weights,
    other processes) and `reserve_bytes` for activations; else `CPU_KV_BLOCKS`. `memory` is
    the GPU's (free, total) bytes, `torch.cuda.mem_get_info` when None. Raises
    InvalidArgument when that leaves no block."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_cache_memory:
        budget, why = cache.kv_cache_memory, f"kv_cache_memory {cache.kv_cache_memory} bytes"
    elif device.type == "cuda":
        free, total = memory or torch.cuda.mem_get_info(device)
        used, share = total - free, int(total * cache.gpu_memory_utilization)
        budget = share - used - reserve_bytes
        why = (
            f"gpu_memory_utilization {cache.gpu_memory_utilization} of {total / _GiB:.1f} GiB "
            f"= {share / _GiB:.1f} GiB, {used / _GiB:.1f} GiB in use (weights, other "
            f"processes), {reserve_bytes / _GiB:.1f} GiB kept for activations"
        )
    else:
        return CPU_KV_BLOCKS
    blocks = budget // block_bytes
    if blocks < 1:
        raise InvalidArgument(
            f"no room for a KV cache: {why} leaves {budget / _GiB:.2f} GiB, a block takes "
            f"{block_bytes} bytes; raise gpu_memory_utilization / kv_cache_memory or set num_blocks"
        )
    return int(blocks)


class KVCache:
    """`num_blocks` blocks for the block manager to hand out, and one more after them,
    `scratch_block`, that no sequence ever owns: the padding rows of a captured decode step
    (`cluster.engine.cuda_graphs`) store their keys and values there, away from live blocks."""

    def __init__(self, layout: KVLayout, num_blocks: int, dtype: torch.dtype, device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        shape = (layout.num_layers, num_blocks + 1, *layout.block_shape)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.k[i], self.v[i]) for i in range(self.layout.num_layers)]

    def read(
        self, block_ids: list[int], layers: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the blocks: `[layers, len(block_ids), block_size, kv_heads, head_dim]`."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        return self.k[layers, idx].contiguous(), self.v[layers, idx].contiguous()

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the keys and values of the blocks in one tensor, on the pool's device and
        the current stream: `[2 (k, v), layers, len(block_ids), block_size, kv_heads, head_dim]`."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        out = torch.empty((2, self.layout.num_layers, len(block_ids), *self.layout.block_shape),
                          dtype=self.k.dtype, device=self.k.device)  # fmt: skip
        torch.index_select(self.k, 1, idx, out=out[0])
        torch.index_select(self.v, 1, idx, out=out[1])
        return out

    def write(
        self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor, layers: slice = slice(None)
    ) -> None:
        num_layers = len(range(self.layout.num_layers)[layers])
        expect = (num_layers, len(block_ids), *self.layout.block_shape)
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise FailedPrecondition(f"KV shape {tuple(k.shape)} does not match pool {expect}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        self.k[layers, idx] = k.to(device=self.k.device, dtype=self.k.dtype)
        self.v[layers, idx] = v.to(device=self.v.device, dtype=self.v.dtype)
