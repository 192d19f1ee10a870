"""The paged KV pool of one engine, and the layout fingerprint two pools must share.

Shape of each per-layer tensor: `[num_blocks, block_size, num_kv_heads, head_dim]`, one for keys
and one for values. Block `b` of every layer together holds the K/V of `block_size` consecutive
tokens of whichever sequence owns block `b` (see `BlockManager` for ownership).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from cluster.errors import FailedPrecondition


@dataclass(frozen=True)
class KVLayout:
    """Everything that must match for KV written by one engine to be read by another."""

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

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


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, dtype: torch.dtype, device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (layout.num_layers, num_blocks, *layout.block_shape)
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
