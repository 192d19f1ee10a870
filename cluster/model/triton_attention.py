"""Paged attention for a GPU in one Triton kernel: every sequence of a batch, prefill chunks and
decodes alike, reads its keys and values in place from the paged pool through its block table.

No padded copy of a context is gathered, no dense mask is built: a program takes a tile of one
sequence's query rows (query position x the query heads that share one KV head, so each K/V tile
is read once for the whole GQA group), walks the sequence's KV blocks from the first one its
sliding window can see up to the one holding its last query's position, and keeps an online
softmax (running max and sum) in registers. Causality and the window are position compares on
the tile. A decode is a sequence with one query; a prefill chunk after cached blocks is one
whose queries start at `context_start`.

`TritonAttention` is chosen by the model runner on CUDA (`select_varlen_attention`); the CPU keeps
its C++ decode kernel and SDPA. The kernel is tested on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, set by the tests' conftest when no GPU is present) against the torch
reference path, and on a GPU by the `gpu` tests.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VarlenBatch:
    """`B` sequences of a step. Sequence b's `query_lens[b]` new tokens are rows
    `query_starts[b] ...` of the flat stream, at positions `context_starts[b] ...`; its keys are
    positions `[0, context_starts[b] + query_lens[b])`, in pool blocks `block_tables[b, :]`."""

    query_starts: torch.Tensor  # [B] int32
    query_lens: torch.Tensor  # [B] int32
    context_starts: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int  # sizes the launch grid: known on the host, no device sync


def build_varlen_batch(
    query_starts: list[int],
    query_lens: list[int],
    context_starts: list[int],
    block_tables: list[list[int]],
    device: torch.device,
) -> VarlenBatch:
    """One host buffer of all the metadata, copied to the device in one transfer (no sync);
    each field is a contiguous slice of it."""
    b, width = len(query_lens), max(len(t) for t in block_tables)
    rows = [*query_starts, *query_lens, *context_starts]
    for table in block_tables:
        rows += table + [0] * (width - len(table))
    dev = upload(rows, torch.int32, device)
    tables = dev[3 * b :].view(b, width)
    return VarlenBatch(dev[:b], dev[b : 2 * b], dev[2 * b : 3 * b], tables, max(query_lens))


def upload(
    values: list[int] | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`values` as one tensor on `device`: on a GPU from pinned memory, asynchronously (no
    device sync; the engine's step metadata and the sampler's per-row settings)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class TritonAttention:
    sliding_window: int | None

    def __call__(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        batch: VarlenBatch,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        triton = _triton()
        q = q.contiguous()
        num_tokens, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        rows = max(16, triton.next_power_of_2(min(batch.max_query_len * group, 64)))
        grid = (
            batch.query_lens.shape[0],
            num_kv_heads,
            triton.cdiv(batch.max_query_len * group, rows),
        )
        _kernel()[grid](
            q, k_cache, v_cache, out,
            batch.block_tables, batch.query_starts, batch.query_lens, batch.context_starts,
            scale, self.sliding_window or 0,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            batch.block_tables.stride(0),
            GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=rows,
            # fp32 models get fp32 products (as the CPU paths), not TF32's 10-bit mantissa
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )  # fmt: skip
        return out


def select_varlen_attention(
    device: torch.device, sliding_window: int | None, block_size: int
) -> TritonAttention | None:
    """Triton on a CUDA device where it imports and the pool's blocks fill a tile (16 tokens
    or more, a power of two: `tl.dot`'s minimum); None elsewhere (the CPU paths run)."""
    if device.type != "cuda" or block_size < 16 or block_size & (block_size - 1):
        return None
    try:
        _triton()
    except ImportError:
        return None
    return TritonAttention(sliding_window)


def interpreted() -> bool:
    """Whether Triton kernels run under its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _triton():
    import triton

    return triton


@functools.cache
def _kernel():
    """The kernel, compiled (or wrapped for the interpreter) on first use: its module imports
    Triton, and `TRITON_INTERPRET` is read when the kernel is defined."""
    from cluster.model.triton_kernels import paged_attention

    return paged_attention
