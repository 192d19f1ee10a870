"""One decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3), in Hugging Face names.

Per-architecture differences are explicit switches in `ArchSpec`, read from the HF config:
QKV bias (Qwen2), q/k RMSNorm (Qwen3), tied embeddings, sliding-window attention (Mistral),
and the RoPE variant. Module attribute names follow HF so checkpoints load with no renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.attention import AttentionMetadata, paged_attention
from cluster.model.info import ArchSpec
from cluster.model.linear import Linear
from cluster.model.rope import RopeAngles, RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's order: normalise in fp32, cast back, then scale; one fused op instead of six.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ArchSpec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = Linear(h, spec.num_heads * d, bias=spec.qkv_bias)
        self.k_proj = Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.v_proj = Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.o_proj = Linear(spec.num_heads * d, h, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.scale = d**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        angles: RopeAngles,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = angles.apply(q, k)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: ArchSpec) -> None:
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj = Linear(h, i, bias=spec.mlp_bias)
        self.up_proj = Linear(h, i, bias=spec.mlp_bias)
        self.down_proj = Linear(i, h, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec) -> None:
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, angles, kv, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), angles, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, spec: ArchSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward` runs the new tokens of a batch through every layer, writing their K/V into
    `kv_caches` (one (k, v) pair of pool tensors per layer), and returns the final hidden
    states; `logits` turns the rows that sample into vocabulary scores."""

    def __init__(self, spec: ArchSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
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
        x = self.model.embed_tokens(input_ids)
        angles = self.rotary(positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, angles, kv, meta)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
