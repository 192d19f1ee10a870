"""The decoder's small steps fused for a GPU: one Triton kernel each where the eager path
launches several (kernels in `triton_kernels.py`).

- `rope_store`: per token, Qwen3's q/k RMSNorm if the model has it, rope on q and k (the neox
  pairing of each head's first half with its second, the one variant `rope.py` builds; the
  Llama-3 rescaling lives in the cos/sin tables), the rotated k and the v written into the paged
  pool at the token's slot, and the rotated q returned. Eager: 10 rope ops (14 with q/k norm) and
  two index stores.
- `add_rms_norm`: the residual add and RMSNorm in one pass, returning the normed rows and the new
  residual (vLLM's `fused_add_rms_norm`, out of place).
- `silu_mul`: SiLU(gate) * up over the fused gate_up GEMM's two halves.

Each rounds to the model dtype where the eager ops do (after each product, sum and norm), so it
equals the eager path to fp32 rounding, and in bf16 to the last bit in most elements.

`TritonKernels` is the decoder's kernel set on the Triton path (the runner chose Triton attention);
`decoder.EagerKernels` is the CPU's. Launches are sized from tensor shapes only: no host sync and
no branch on tensor values, so a step stays capturable in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cluster.model.rms_norm import RMSNorm

if TYPE_CHECKING:
    from cluster.model.rope import RotaryEmbedding


@dataclass(frozen=True)
class RopeLookup:
    """A step's positions and the model's whole cos/sin tables: the kernel looks rows up itself."""

    positions: torch.Tensor  # [T] long
    cos: torch.Tensor  # [max_positions, head_dim] fp32
    sin: torch.Tensor


class TritonKernels:
    """The decoder's steps on the Triton path; the contract of `decoder.EagerKernels`."""

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype) -> RopeLookup:
        return RopeLookup(positions, rotary.cos, rotary.sin)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, norm.weight, norm.eps)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate, up)

    def rope_store(self, q, k, v, qk_norm, rope: RopeLookup, kv, slot_mapping) -> torch.Tensor:
        return rope_store(q, k, v, rope, kv[0], kv[1], slot_mapping, qk_norm)


def rope_store(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    rope: RopeLookup,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] long; a negative slot (padding) stores nothing
    qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim], the rotated q
    """Rotate q and k by their positions (after q/k RMSNorm when `qk_norm` is given), write the
    rotated k and v into the pool at `slot_mapping`, return the rotated q. q, k and v may be
    row-strided views (the fused qkv GEMM's output)."""
    triton = _triton()
    q, k, v = _inner_contiguous(q), _inner_contiguous(k), _inner_contiguous(v)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q_w, k_w, eps = (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps) if qk_norm else (q, q, 0)
    _kernels().rope_store[(num_tokens,)](
        q, k, v, out, k_cache, v_cache,
        rope.positions, slot_mapping, rope.cos, rope.sin, q_w, k_w,
        eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        rope.cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, QK_NORM=qk_norm is not None,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor,  # [T, hidden]
    residual: torch.Tensor | None,  # [T, hidden]; None for the first layer
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (RMSNorm(x + residual), x + residual)
    """RMSNorm of `x + residual`, and that sum, the residual stream's next value (`x` itself
    when there is no residual yet)."""
    triton = _triton()
    x = _inner_contiguous(x)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    new_residual = x if residual is None else torch.empty_like(out)
    residual = x if residual is None else _inner_contiguous(residual)
    block = triton.next_power_of_2(hidden)
    _kernels().add_rms_norm[(num_tokens,)](
        x, residual, weight, out, new_residual,
        eps, x.stride(0), residual.stride(0), out.stride(0),
        HIDDEN=hidden, HAS_RESIDUAL=new_residual is not x, BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )  # fmt: skip
    return out, new_residual


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, `[T, intermediate]`; gate and up may be the two halves (row-strided
    views) of the fused gate_up GEMM's output."""
    triton = _triton()
    gate, up = _inner_contiguous(gate), _inner_contiguous(up)
    num_tokens, width = gate.shape
    out = torch.empty((num_tokens, width), dtype=gate.dtype, device=gate.device)
    block = min(triton.next_power_of_2(width), 1024)
    _kernels().silu_mul[(num_tokens, triton.cdiv(width, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), WIDTH=width, BLOCK=block
    )
    return out


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` if only its first dimension is strided (a view of rows of a wider tensor), else a
    contiguous copy: the kernels take one stride per leading dimension and unit steps inside."""
    inner = x[0] if x.dim() > 1 and x.shape[0] > 0 else x
    return x if inner.is_contiguous() else x.contiguous()


@functools.cache
def _triton():
    import triton

    return triton


@functools.cache
def _kernels():
    """The kernels module, imported on first use (it imports Triton; `TRITON_INTERPRET` is read
    when its kernels are defined)."""
    from cluster.model import triton_kernels

    return triton_kernels
