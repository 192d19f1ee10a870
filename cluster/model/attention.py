"""Paged attention over the block tables of a batch of sequences of different lengths.

The model sees one flat stream of `T` new tokens (sequences back to back). Attention metadata
says, per sequence group, where each sequence's queries sit in that stream and which pool blocks
hold its keys and values. Decoding sequences (one query each) and prefill chunks (many queries)
form separate groups so that neither pays for the other's padding; the decode group is attended
by a `DecodeAttention` implementation chosen once per model runner, the prefill group by SDPA.
On a GPU one Triton kernel attends the whole batch in place instead (`triton_attention.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.model.decode_attention import DecodeAttention, DecodeGroup
from cluster.model.triton_attention import TritonAttention, VarlenBatch


@dataclass(frozen=True)
class PrefillGroup:
    """`B` sequences attended together. `query_index[b, j]` is the flat-stream index of query j
    of sequence b (padding points at 0 and is dropped via `query_valid`). `mask[b, 0, j, k]`
    says whether query j may see key position k of the gathered context."""

    query_index: torch.Tensor  # [B, max_q] long
    query_valid: torch.Tensor  # [B, max_q] bool
    block_tables: torch.Tensor  # [B, max_blocks] long
    mask: torch.Tensor  # [B, 1, max_q, max_blocks * block_size] bool


@dataclass(frozen=True)
class AttentionMetadata:
    """Either `varlen` (the whole batch, for one kernel that reads the pool in place: Triton on
    a GPU) or the `decode` / `prefill` groups (the CPU's C++ decode kernel and SDPA)."""

    slot_mapping: torch.Tensor  # [T] long: pool slot (block * block_size + offset) per new token
    decode: DecodeGroup | None
    prefill: PrefillGroup | None
    decode_attention: DecodeAttention | None  # the implementation the runner chose for `decode`
    varlen: VarlenBatch | None = None
    varlen_attention: TritonAttention | None = None


def _padded_tables(block_tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    width = max(len(t) for t in block_tables)
    # One tensor from padded lists: a tensor per row costs a call each at decode batch sizes.
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=dtype)


def build_decode_group(
    rows: list[int], positions: list[int], block_tables: list[list[int]], device: torch.device
) -> DecodeGroup:
    """Sequence b's one new token is flat row `rows[b]`, at position `positions[b]`."""
    return DecodeGroup(
        rows=torch.tensor(rows, dtype=torch.long).to(device),
        block_tables=_padded_tables(block_tables, torch.int32).to(device),
        context_lens=(torch.tensor(positions, dtype=torch.int32) + 1).to(device),
    )


def build_prefill_group(
    query_starts: list[int],
    query_lens: list[int],
    context_starts: list[int],
    block_tables: list[list[int]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> PrefillGroup:
    """Sequence b has `query_lens[b]` new tokens at flat index `query_starts[b]`, at positions
    `context_starts[b] ...`; its keys are positions `[0, context_starts[b] + query_lens[b])`."""
    max_q = max(query_lens)
    max_blocks = max(len(t) for t in block_tables)
    q_off = torch.arange(max_q)
    qlen = torch.tensor(query_lens)
    valid = q_off[None, :] < qlen[:, None]  # [B, max_q]
    index = torch.where(valid, torch.tensor(query_starts)[:, None] + q_off[None, :], 0)
    q_pos = torch.tensor(context_starts)[:, None] + q_off[None, :]  # [B, max_q]
    q_pos = torch.where(valid, q_pos, 0)  # padded rows see key 0 only, never an all-masked row
    k_pos = torch.arange(max_blocks * block_size)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, max_q, max_k]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return PrefillGroup(
        query_index=index.to(device),
        query_valid=valid.to(device),
        block_tables=_padded_tables(block_tables, torch.long).to(device),
        mask=mask[:, None].to(device),
    )


def store_kv(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] long
) -> None:
    """Write the new tokens' keys and values into their pool slots."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Attend every query to its sequence's keys, the step's own already in the pool
    (`store_kv`)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if meta.varlen is not None:
        return meta.varlen_attention(q, k_cache, v_cache, meta.varlen, scale)
    d, p = meta.decode, meta.prefill
    if p is None:  # a pure decode batch: rows are 0..T-1 in order
        return meta.decode_attention(q, k_cache, v_cache, d, scale)
    out = torch.empty_like(q)
    if d is not None:
        out[d.rows] = meta.decode_attention(q[d.rows], k_cache, v_cache, d, scale)
    bsz, max_blocks = p.block_tables.shape
    context = (bsz, max_blocks * block_size, num_kv_heads, head_dim)
    tables = p.block_tables.flatten()
    kg = k_cache.index_select(0, tables).view(context).transpose(1, 2)  # [B, Hkv, K, D]
    vg = v_cache.index_select(0, tables).view(context).transpose(1, 2)
    qg = q[p.query_index].transpose(1, 2)  # [B, num_heads, max_q, head_dim]
    og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=p.mask, scale=scale, enable_gqa=True)
    og = og.transpose(1, 2)  # [B, max_q, num_heads, head_dim]
    out[p.query_index[p.query_valid]] = og[p.query_valid]
    return out
