"""Paged attention over the block tables of a batch of sequences of different lengths.

The model sees one flat stream of `T` new tokens (sequences back to back). Attention metadata
says, per sequence group, where each sequence's queries sit in that stream and which pool blocks
hold its keys and values. Decoding sequences (one query each) and prefill chunks (many queries)
form separate groups so that neither pays for the other's padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionGroup:
    """`B` sequences attended together. `query_index[b, j]` is the flat-stream index of query j
    of sequence b (padding points at 0 and is dropped via `query_valid`). `mask[b, 0, j, k]`
    says whether query j may see key position k of the gathered context."""

    query_index: torch.Tensor  # [B, max_q] long
    query_valid: torch.Tensor  # [B, max_q] bool
    block_tables: torch.Tensor  # [B, max_blocks] long
    mask: torch.Tensor  # [B, 1, max_q, max_blocks * block_size] bool


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: pool slot (block * block_size + offset) per new token
    groups: tuple[AttentionGroup, ...]


def build_group(
    query_starts: list[int],
    query_lens: list[int],
    context_starts: list[int],
    block_tables: list[list[int]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> AttentionGroup:
    """Sequence b has `query_lens[b]` new tokens at flat index `query_starts[b]`, at positions
    `context_starts[b] ...`; its keys are positions `[0, context_starts[b] + query_lens[b])`."""
    bsz = len(query_lens)
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
    tables = torch.zeros(bsz, max_blocks, dtype=torch.long)
    for b, t in enumerate(block_tables):
        tables[b, : len(t)] = torch.tensor(t, dtype=torch.long)
    return AttentionGroup(
        query_index=index.to(device),
        query_valid=valid.to(device),
        block_tables=tables.to(device),
        mask=mask[:, None].to(device),
    )


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Store the new keys/values in the pool, then attend every query to its sequence's keys."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = k
    v_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = v
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    for g in meta.groups:
        bsz, max_blocks = g.block_tables.shape
        tables = g.block_tables.flatten()
        context = (bsz, max_blocks * block_size, num_kv_heads, head_dim)
        kg = k_cache.index_select(0, tables).view(context).transpose(1, 2)  # [B, Hkv, K, D]
        vg = v_cache.index_select(0, tables).view(context).transpose(1, 2)
        if g.query_index.shape[1] == 1:
            # Decode: one query per sequence. Fold each KV head's query heads into the query
            # axis ([B, Hkv, heads per KV head, D]) so keys are read once, not repeated.
            rows = g.query_index[:, 0]
            qg = q[rows].view(bsz, num_kv_heads, num_heads // num_kv_heads, head_dim)
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale)
            out[rows] = og.reshape(bsz, num_heads, head_dim)
            continue
        qg = q[g.query_index].transpose(1, 2)  # [B, num_heads, max_q, head_dim]
        og = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True
        )
        og = og.transpose(1, 2)  # [B, max_q, num_heads, head_dim]
        out[g.query_index[g.query_valid]] = og[g.query_valid]
    return out
