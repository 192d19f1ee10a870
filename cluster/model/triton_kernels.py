"""Triton kernels (imported on first use by `cluster.model.triton_attention`, which documents
them): a GPU, or Triton's interpreter on the CPU (`TRITON_INTERPRET=1`)."""

import triton
import triton.language as tl


@triton.jit
def paged_attention(
    q_ptr, k_ptr, v_ptr, out_ptr,
    tables_ptr, q_starts_ptr, q_lens_ptr, ctx_starts_ptr,
    scale, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_table,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + seq)
    if tile * BLOCK_M < q_len * GROUP:
        q_start = tl.load(q_starts_ptr + seq)
        ctx_start = tl.load(ctx_starts_ptr + seq)
        # Row r of the tile: query (tile * BLOCK_M + r) // GROUP, head kv_head * GROUP + ...
        row = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        query = row // GROUP
        head = kv_head * GROUP + row % GROUP
        row_ok = query < q_len
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q_rows = (q_start + query) * stride_qt + head * stride_qh
        q = tl.load(
            q_ptr + q_rows[:, None] + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        q_pos = ctx_start + query
        last = ctx_start + tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // GROUP)
        # The first key the tile's earliest query sees (its window's start, or 0).
        windowed = tl.maximum(ctx_start + (tile * BLOCK_M) // GROUP - window + 1, 0)
        first = tl.where(window > 0, windowed, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        slots = tl.arange(0, BLOCK_SIZE)
        for blk in range(first // BLOCK_SIZE, last // BLOCK_SIZE + 1):
            block = tl.load(tables_ptr + seq * stride_table + blk).to(tl.int64)
            kv_rows = block * stride_kb + slots * stride_ks + kv_head * stride_kh
            kv_at = kv_rows[:, None] + dims[None, :]
            k = tl.load(k_ptr + kv_at, mask=dim_ok[None, :], other=0.0)
            v = tl.load(v_ptr + kv_at, mask=dim_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            k_pos = blk * BLOCK_SIZE + slots
            seen = (k_pos[None, :] <= q_pos[:, None]) & (
                (window <= 0) | (k_pos[None, :] > q_pos[:, None] - window)
            )
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row seeing nothing yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
