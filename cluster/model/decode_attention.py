"""How a decode group (one query per sequence) attends to its paged keys and values.

Two implementations of one contract, chosen once per model runner by `select_decode_attention`:

- `KernelDecodeAttention`: a C++ kernel (`csrc/paged_attention.cpp`, compiled on first use into
  torch's extension cache) that reads K/V in place through the block table;
- `TorchDecodeAttention`: gathers each sequence's blocks into a padded tensor and runs SDPA.
  The fallback where the kernel cannot be built or the model is not on the CPU, and the
  reference the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from cluster.model.native import load_extension


@dataclass(frozen=True)
class DecodeGroup:
    """`B` decoding sequences. Sequence b's query is row `rows[b]` of the flat token stream, at
    position `context_lens[b] - 1`; its keys are positions `[0, context_lens[b])`, held in pool
    blocks `block_tables[b, : ceil(context_lens[b] / block_size)]` (the rest is padding)."""

    rows: torch.Tensor  # [B] long
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32


class DecodeAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [B, num_heads, head_dim], the group's queries
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        group: DecodeGroup,
        scale: float,
    ) -> torch.Tensor: ...  # [B, num_heads, head_dim]


@dataclass(frozen=True)
class TorchDecodeAttention:
    sliding_window: int | None

    def __call__(self, q, k_cache, v_cache, group, scale):
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        bsz, max_blocks = group.block_tables.shape
        tables = group.block_tables.flatten()
        context = (bsz, max_blocks * block_size, num_kv_heads, head_dim)
        kg = k_cache.index_select(0, tables).view(context).transpose(1, 2)  # [B, Hkv, K, D]
        vg = v_cache.index_select(0, tables).view(context).transpose(1, 2)
        k_pos = torch.arange(max_blocks * block_size, device=q.device)
        ctx = group.context_lens[:, None]
        mask = k_pos[None, :] < ctx  # [B, K]
        if self.sliding_window is not None:
            mask &= k_pos[None, :] >= ctx - self.sliding_window
        # Fold each KV head's query heads into the query axis ([B, Hkv, heads per KV head, D])
        # so keys are read once, not repeated.
        qg = q.view(bsz, num_kv_heads, q.shape[1] // num_kv_heads, head_dim)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask[:, None, None], scale=scale)
        return og.reshape(q.shape)


@dataclass(frozen=True)
class KernelDecodeAttention:
    sliding_window: int | None
    kernel: object  # the compiled extension module

    def __call__(self, q, k_cache, v_cache, group, scale):
        # The kernel validates shapes, dtypes, contiguity and every block id it will read.
        return self.kernel.paged_decode_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            group.block_tables,
            group.context_lens,
            scale,
            self.sliding_window or 0,
        )


def select_decode_attention(device: torch.device, sliding_window: int | None) -> DecodeAttention:
    """The kernel on the CPU when it builds; otherwise the torch path (with one warning)."""
    kernel = load_kernel() if device.type == "cpu" else None
    if kernel is None:
        return TorchDecodeAttention(sliding_window)
    return KernelDecodeAttention(sliding_window, kernel)


def load_kernel() -> object | None:
    """The compiled paged attention kernel, or None where it cannot be built."""
    return load_extension("pdserve_paged_attention", "paged_attention.cpp", openmp=True)
