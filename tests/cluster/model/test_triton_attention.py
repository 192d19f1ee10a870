"""The Triton paged attention kernel against a dense torch reference, on batches that mix
decodes, whole prompts and prefill chunks after cached blocks, with GQA, sliding windows and
head sizes that are not powers of two. On the CPU it runs under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 without a GPU); the `gpu` cases compile it."""

from __future__ import annotations

import pytest
import torch

from cluster.model.triton_attention import (
    TritonAttention,
    build_varlen_batch,
    select_varlen_attention,
)

pytest.importorskip("triton")

NUM_BLOCKS = 64
# (query tokens, position of the first): decodes, a whole prompt, chunks after cached blocks
SEQS = [(1, 0), (1, 37), (9, 0), (20, 16), (1, 70), (6, 33)]


def _batch(block_size, group, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_kv_heads = 2
    shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(device, dtype)
    v_cache = torch.randn(shape, generator=g).to(device, dtype)
    order = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    starts, tables, at = [], [], 0
    for q_len, ctx in SEQS:
        starts.append(at)
        at += q_len
        tables.append([order.pop() for _ in range(-(-(ctx + q_len) // block_size))])
    q = torch.randn(at, num_kv_heads * group, head_dim, generator=g).to(device, dtype)
    lens, ctxs = [n for n, _ in SEQS], [c for _, c in SEQS]
    batch = build_varlen_batch(starts, lens, ctxs, tables, torch.device(device))
    return q, k_cache, v_cache, batch, (starts, tables)


def _reference(q, k_cache, v_cache, layout, scale, window):
    """Each sequence alone: its keys gathered, a causal (and windowed) mask, plain softmax."""
    starts, tables = layout
    out = torch.zeros_like(q, dtype=torch.float32)
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for (q_len, ctx), start, table in zip(SEQS, starts, tables, strict=True):
        n = ctx + q_len
        idx = torch.tensor(table, device=q.device)
        k = k_cache[idx].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_cache[idx].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        # The table holds exactly the blocks the context fills: all n keys, none past them.
        assert k.shape[0] == n and len(table) == -(-n // block_size), (n, len(table))
        qs = q[start : start + q_len].float()  # [q_len, H, D]
        s = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = torch.arange(ctx, n, device=q.device)[:, None]
        k_pos = torch.arange(n, device=q.device)[None, :]
        seen = k_pos <= q_pos
        if window:
            seen &= k_pos > q_pos - window
        s = s.masked_fill(~seen, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def _check(device, block_size, group, head_dim, window, dtype, tol):
    q, k_cache, v_cache, batch, layout = _batch(block_size, group, head_dim, dtype, device)
    scale = head_dim**-0.5
    got = TritonAttention(window)(q, k_cache, v_cache, batch, scale)
    want = _reference(q, k_cache, v_cache, layout, scale, window)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 16), (4, 24)])
@pytest.mark.parametrize("block_size", [16, 4])
def test_kernel_equals_dense_reference_under_the_interpreter(block_size, group, head_dim, window):
    if torch.cuda.is_available():
        pytest.skip("the interpreter cases run where no GPU is")
    _check("cpu", block_size, group, head_dim, window, torch.float32, 1e-5)
    _check("cpu", block_size, group, head_dim, window, torch.float16, 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (4, 128), (3, 80)])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
def test_kernel_equals_dense_reference_on_the_gpu(group, head_dim, window, dtype, tol):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check("cuda", 16, group, head_dim, window, dtype, tol)


def test_the_kernel_is_chosen_on_cuda_only_for_blocks_that_fill_a_tile():
    cpu = torch.device("cpu")
    assert select_varlen_attention(cpu, None, 16) is None
    meta = torch.device("meta")  # not CUDA either
    assert select_varlen_attention(meta, None, 16) is None
    cuda = torch.device("cuda")
    for block_size in (4, 8, 24):
        assert select_varlen_attention(cuda, None, block_size) is None
    assert select_varlen_attention(cuda, 5, 16) == TritonAttention(5)
