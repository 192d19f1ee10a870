"""The fused Triton kernels of the decoder's GPU path (rope + KV store, residual add + RMSNorm,
SiLU * up) against the eager torch ops they replace (`decoder.EagerKernels`), on odd token counts,
head sizes that are not powers of two, views of the fused GEMMs' outputs, and the presets' shapes.
On the CPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without
a GPU) in fp32 and fp16: the interpreter casts to bf16 by truncation, not rounding, so bf16 is
compared where the kernels compile, in the `gpu` cases."""

from __future__ import annotations

import pytest
import torch

from cluster.model.decoder import EagerKernels
from cluster.model.rms_norm import RMSNorm
from cluster.model.rope import RotaryEmbedding
from cluster.model.triton_fused import TritonKernels

pytest.importorskip("triton")

EAGER, TRITON = EagerKernels(), TritonKernels()
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
NUM_BLOCKS, BLOCK_SIZE, MAX_POSITIONS = 8, 16, 128


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _norm(dim, dtype, device, g):
    norm = RMSNorm(dim, 1e-6).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(dim, generator=g))
    return norm


def _check_rope_store(device, dtype, tokens, heads, kv_heads, head_dim, qk_norm, rope, pad):
    g = torch.Generator().manual_seed(tokens * head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=g).to(device, dtype)  # the fused GEMM's output
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=g).to(device)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:tokens]
    if pad:  # the last row is padding: it must store nothing
        slots[-1] = -1
    slots = slots.to(device)
    norms = (_norm(head_dim, dtype, device, g), _norm(head_dim, dtype, device, g))
    norms = norms if qk_norm else None
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, rope).to(device)
    pool = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
    fill = torch.randn(pool, generator=g).to(device, dtype)
    want_kv, got_kv = (fill.clone(), fill.clone()), (fill.clone(), fill.clone())
    real = slots >= 0
    want_q = EAGER.rope_store(
        q[real], k[real], v[real], norms, EAGER.rope(rotary, positions[real], dtype), want_kv,
        slots[real],
    )  # fmt: skip
    got_q = TRITON.rope_store(q, k, v, norms, TRITON.rope(rotary, positions, dtype), got_kv, slots)
    _close(got_q[real], want_q, dtype)
    _close(got_kv[0], want_kv[0], dtype)
    _close(got_kv[1], want_kv[1], dtype)


def _check_add_rms_norm(device, dtype, tokens, hidden, first):
    g = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    residual = None if first else torch.randn(tokens, hidden, generator=g).to(device, dtype)
    norm = _norm(hidden, dtype, device, g)
    want_h, want_r = EAGER.add_rms_norm(x, residual, norm)
    got_h, got_r = TRITON.add_rms_norm(x, residual, norm)
    _close(got_h, want_h, dtype)
    _close(got_r, want_r, dtype)


def _check_silu_mul(device, dtype, tokens, width):
    g = torch.Generator().manual_seed(tokens + width)
    gate_up = (2 * torch.randn(tokens, 2 * width, generator=g)).to(device, dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # row-strided views, as the fused GEMM gives them
    _close(TRITON.silu_mul(gate, up), EAGER.silu_mul(gate, up), dtype)


def _interpreter_only():
    if torch.cuda.is_available():
        pytest.skip("the interpreter cases run where no GPU is")


# (tokens, heads, kv heads, head dim): the tiny test models, the `small` preset, an odd head dim
ROPE_SHAPES = [(1, 4, 2, 16), (7, 9, 3, 64), (5, 6, 2, 24)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim"), ROPE_SHAPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_rope_store_equals_eager_under_the_interpreter(
    tokens, heads, kv_heads, head_dim, qk_norm, dtype
):
    _interpreter_only()
    rope = LLAMA3_ROPE if qk_norm else {"rope_theta": 10000.0}
    _check_rope_store("cpu", dtype, tokens, heads, kv_heads, head_dim, qk_norm, rope, pad=False)


def test_rope_store_skips_padding_rows_under_the_interpreter():
    _interpreter_only()
    _check_rope_store("cpu", torch.float16, 5, 4, 2, 16, False, {"rope_theta": 1e4}, pad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (5, 576), (3, 200)])
@pytest.mark.parametrize("first", [False, True], ids=["add", "first_layer"])
def test_add_rms_norm_equals_eager_under_the_interpreter(tokens, hidden, first, dtype):
    _interpreter_only()
    _check_add_rms_norm("cpu", dtype, tokens, hidden, first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("tokens", "width"), [(1, 128), (3, 1536), (2, 100)])
def test_silu_mul_equals_eager_under_the_interpreter(tokens, width, dtype):
    _interpreter_only()
    _check_silu_mul("cpu", dtype, tokens, width)


# `small` (9/3 heads of 64, hidden 576, intermediate 1536) and `1b` (32/8 of 64, 2048, 8192)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_fused_kernels_equal_eager_on_the_gpu(tokens, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for heads, kv_heads, head_dim in [(9, 3, 64), (32, 8, 64), (16, 8, 128), (6, 2, 80)]:
        for qk_norm in (False, True):
            rope = LLAMA3_ROPE if qk_norm else {"rope_theta": 10000.0}
            shape = (tokens, heads, kv_heads, head_dim)
            _check_rope_store("cuda", dtype, *shape, qk_norm, rope, pad=tokens > 1)
    for hidden, width in [(576, 1536), (2048, 8192)]:
        for first in (False, True):
            _check_add_rms_norm("cuda", dtype, tokens, hidden, first)
        _check_silu_mul("cuda", dtype, tokens, width)
