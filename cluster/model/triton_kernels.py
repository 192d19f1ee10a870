"""Triton kernels, imported on first use by the modules that document and launch them:
`cluster.model.triton_attention` (paged attention) and `cluster.model.triton_fused` (rope with
the KV store, residual add with RMSNorm, SiLU times up). They run on a GPU, or under Triton's
interpreter on the CPU (`TRITON_INTERPRET=1`)."""

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


@triton.jit
def rope_store(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    positions_ptr, slots_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
    eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_angle,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    half = tl.arange(0, BLOCK_HALF)
    half_ok = half < HALF
    pos = tl.load(positions_ptr + t)
    # The tables' halves are equal (cos(p f) for each frequency f, twice): read the first.
    cos = tl.load(cos_ptr + pos * stride_angle + half, mask=half_ok, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_angle + half, mask=half_ok, other=0.0)
    dtype = q_out_ptr.dtype.element_ty
    cos = cos.to(dtype).to(tl.float32)[None, :]  # the eager path's tables are in the model dtype
    sin = sin.to(dtype).to(tl.float32)[None, :]

    hq = tl.arange(0, BLOCK_HQ)
    q_ok = (hq < NUM_HEADS)[:, None] & half_ok[None, :]
    q_at = q_ptr + t * stride_qt + hq[:, None] * stride_qh + half[None, :]
    q1, q2 = _rope(
        tl.load(q_at, mask=q_ok, other=0.0).to(tl.float32),
        tl.load(q_at + HALF, mask=q_ok, other=0.0).to(tl.float32),
        cos, sin, q_norm_ptr, half, half_ok, eps, dtype, HEAD_DIM, QK_NORM,
    )  # fmt: skip
    out_at = q_out_ptr + t * stride_ot + hq[:, None] * stride_oh + half[None, :]
    tl.store(out_at, q1, mask=q_ok)
    tl.store(out_at + HALF, q2, mask=q_ok)

    # A negative slot (a padding row) stores nothing.
    slot = tl.load(slots_ptr + t)
    hk = tl.arange(0, BLOCK_HKV)
    # `slot` broadcast to the mask's shape first: Triton 3.9's interpreter refuses a mask
    # that `&`s a scalar into a tensor ("mask has unsupported dtype"); compiled, it is the same.
    slots = tl.zeros([BLOCK_HKV], dtype=slot.dtype) + slot
    kv_ok = (hk < NUM_KV_HEADS)[:, None] & half_ok[None, :] & (slots >= 0)[:, None]
    k_at = k_ptr + t * stride_kt + hk[:, None] * stride_kh + half[None, :]
    k1, k2 = _rope(
        tl.load(k_at, mask=kv_ok, other=0.0).to(tl.float32),
        tl.load(k_at + HALF, mask=kv_ok, other=0.0).to(tl.float32),
        cos, sin, k_norm_ptr, half, half_ok, eps, dtype, HEAD_DIM, QK_NORM,
    )  # fmt: skip
    row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    cache_at = row + hk[:, None] * stride_ch + half[None, :]
    tl.store(k_cache_ptr + cache_at, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(k_cache_ptr + cache_at + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
    v_at = v_ptr + t * stride_vt + hk[:, None] * stride_vh + half[None, :]
    v_out = v_cache_ptr.dtype.element_ty
    tl.store(v_cache_ptr + cache_at, tl.load(v_at, mask=kv_ok).to(v_out), mask=kv_ok)
    tl.store(v_cache_ptr + cache_at + HALF, tl.load(v_at + HALF, mask=kv_ok).to(v_out), mask=kv_ok)


@triton.jit
def _rope(x1, x2, cos, sin, norm_ptr, half, half_ok, eps, dtype, HEAD_DIM: tl.constexpr,
          QK_NORM: tl.constexpr):  # fmt: skip
    """Rotate the halves `x1`, `x2` ([heads, half], fp32) of each head as the eager path does,
    rounding to `dtype` where it does: after the optional RMSNorm, after each product, and
    after the sum (neox style: the first half pairs with the second)."""
    if QK_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(norm_ptr + half, mask=half_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_ptr + HEAD_DIM // 2 + half, mask=half_ok, other=0.0)
        x1 = (x1 * rstd * w1).to(dtype).to(tl.float32)
        x2 = (x2 * rstd * w2.to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    c1 = (x1 * cos).to(dtype).to(tl.float32)
    c2 = (x2 * cos).to(dtype).to(tl.float32)
    s1 = (x1 * sin).to(dtype).to(tl.float32)
    s2 = (x2 * sin).to(dtype).to(tl.float32)
    return (c1 - s2).to(dtype), (c2 + s1).to(dtype)


@triton.jit
def add_rms_norm(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    eps, stride_x, stride_r, stride_o,
    HIDDEN: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    dtype = out_ptr.dtype.element_ty
    s = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        s = (s + r).to(dtype)  # the sum, as the eager add rounds it, is the new residual
        tl.store(residual_out_ptr + t * HIDDEN + cols, s, mask=ok)
        s = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (s * rstd * w).to(dtype), mask=ok)


@triton.jit
def silu_mul(
    gate_ptr, up_ptr, out_ptr, stride_g, stride_u, stride_o,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < WIDTH
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + t * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + t * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # rounded, as F.silu's output
    tl.store(out_ptr + t * stride_o + cols, (silu * u).to(dtype), mask=ok)
