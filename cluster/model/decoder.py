"""One decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3), in Hugging Face names.

Per-architecture differences are explicit switches in `ArchSpec`, read from the HF config:
QKV bias (Qwen2), q/k RMSNorm (Qwen3), tied embeddings, sliding-window attention (Mistral),
and the RoPE variant. Module attribute names follow HF so checkpoints load with no renaming;
once loaded, `fuse_projections` joins q/k/v and gate/up into one GEMM each.

Built with a `TPGroup` of k > 1 ranks, each rank's decoder holds its `TPShard` (the Megatron
split, `cluster.model.parallel`): its query and KV heads, its intermediate columns, its rows of
the vocabulary; o_proj and down_proj are row-parallel (one all-reduce each per layer), the
embedding and LM head vocabulary-parallel. At TP 1 the same classes as ever, no collective.

The steps between the GEMMs and attention (residual add + RMSNorm, rope + KV store, SiLU * up)
run through a kernel set chosen per forward pass from the attention metadata: `EagerKernels`
(torch ops; the CPU's path and the reference) or, where the runner chose Triton attention,
`triton_fused.TritonKernels` (one kernel per step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.attention import AttentionMetadata, paged_attention, store_kv
from cluster.model.info import ArchSpec
from cluster.model.linear import Linear
from cluster.model.parallel.group import SINGLE, TPGroup
from cluster.model.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from cluster.model.parallel.shard import TPShard
from cluster.model.rms_norm import RMSNorm
from cluster.model.rope import RopeAngles, RotaryEmbedding
from cluster.model.triton_fused import TritonKernels


class EagerKernels:
    """The decoder's steps between GEMMs as torch ops. `TritonKernels` has the same contract."""

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype) -> RopeAngles:
        return rotary(positions, dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(x + residual), x + residual)
        residual = x if residual is None else x + residual
        return norm(residual), residual

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def rope_store(self, q, k, v, qk_norm, rope: RopeAngles, kv, slot_mapping) -> torch.Tensor:
        """Rotate q and k (after their RMSNorms when `qk_norm` is given), store k and v into
        the pool at `slot_mapping`, return q."""
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        q, k = rope.apply(q, k)
        store_kv(k, v, kv[0], kv[1], slot_mapping)
        return q


Kernels = EagerKernels | TritonKernels
EAGER, TRITON = EagerKernels(), TritonKernels()


def _row_parallel(in_features: int, out_features: int, bias: bool, tp: TPGroup) -> Linear:
    """A Linear whose input features are split over the ranks (a plain one at TP 1)."""
    if tp.world_size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class Attention(nn.Module):
    """This rank's heads (all of them at TP 1)."""

    def __init__(self, spec: ArchSpec, shard: TPShard, tp: TPGroup) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads = shard.local_heads, shard.local_kv_heads
        self.head_dim = d
        self.q_proj = Linear(h, self.num_heads * d, bias=spec.qkv_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=spec.qkv_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=spec.qkv_bias)
        self.o_proj = _row_parallel(self.num_heads * d, h, spec.o_bias, tp)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.scale = d**-0.5
        self.qkv_proj: Linear | None = None  # q, k and v in one GEMM, once `fuse` ran

    def fuse(self) -> None:
        """Replace q_proj, k_proj and v_proj (as loaded) by one `qkv_proj` over their
        concatenated weights: one GEMM (one kernel launch) instead of three."""
        self.qkv_proj = _fused(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope,  # the kernel set's: RopeAngles (eager) or RopeLookup (Triton)
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kernels: Kernels,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:
            widths = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
            q, k, v = self.qkv_proj(x).split(widths, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        qk_norm = (self.q_norm, self.k_norm) if self.qk_norm else None
        q = kernels.rope_store(q, k, v, qk_norm, rope, kv, meta.slot_mapping)
        o = paged_attention(q, kv[0], kv[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: ArchSpec, shard: TPShard, tp: TPGroup) -> None:
        super().__init__()
        h, i = spec.hidden_size, shard.local_intermediate
        self.gate_proj = Linear(h, i, bias=spec.mlp_bias)
        self.up_proj = Linear(h, i, bias=spec.mlp_bias)
        self.down_proj = _row_parallel(i, h, spec.mlp_bias, tp)
        self.gate_up_proj: Linear | None = None  # gate and up in one GEMM, once `fuse` ran

    def fuse(self) -> None:
        """Replace gate_proj and up_proj (as loaded) by one `gate_up_proj`."""
        self.gate_up_proj = _fused(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(kernels.silu_mul(gate, up))


def _fused(*parts: Linear) -> Linear:
    """One Linear whose output is the outputs of `parts`, side by side."""
    weight = torch.cat([p.weight.detach() for p in parts])
    fused = Linear(
        parts[0].in_features,
        weight.shape[0],
        bias=parts[0].bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(weight)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, shard: TPShard, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Attention(spec, shard, tp)
        self.mlp = MLP(spec, shard, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, residual, rope, kv, meta, kernels: Kernels):
        """`x + residual` is the residual stream entering the layer (`x` alone for the first);
        returns the pair leaving it, the add left to the next norm to fuse."""
        h, residual = kernels.add_rms_norm(x, residual, self.input_layernorm)
        x = self.self_attn(h, rope, kv, meta, kernels)
        h, residual = kernels.add_rms_norm(x, residual, self.post_attention_layernorm)
        return self.mlp(h, kernels), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ArchSpec, shard: TPShard, tp: TPGroup) -> None:
        super().__init__()
        if tp.world_size == 1:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(shard, spec.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, shard, tp) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward` runs the new tokens of a batch through every layer, writing their K/V into
    `kv_caches` (one (k, v) pair of pool tensors per layer), and returns the final hidden
    states; `logits` turns the rows that sample into vocabulary scores (the whole vocabulary's,
    on every rank). At TP > 1 every rank must run the same calls on the same batch."""

    def __init__(self, spec: ArchSpec, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        self.shard = TPShard.of(spec, tp.rank, tp.world_size)
        self.model = DecoderModel(spec, self.shard, tp)
        if tp.world_size == 1:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        else:
            self.lm_head = ParallelLMHead(self.shard, spec.hidden_size, tp)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        # Triton attention was chosen for this step: the fused kernels come with it.
        kernels = EAGER if meta.varlen is None else TRITON
        x = self.model.embed_tokens(input_ids)
        rope = kernels.rope(self.rotary, positions, x.dtype)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv, meta, kernels)
        return kernels.add_rms_norm(x, residual, self.model.norm)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def fuse_projections(self) -> None:
        """Fuse every layer's q/k/v and gate/up projections (after the checkpoint is loaded:
        the fused modules have no HF names)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
