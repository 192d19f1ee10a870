"""Rotary position embedding (RoFormer), with the Llama-3 frequency rescaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from cluster.errors import InvalidArgument

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` for a HF `rope_parameters` dict."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    base = float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    raise InvalidArgument(
        f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_scale(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Long wavelengths are divided by `factor`, short ones kept, the band between blended."""
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_len = float(rope["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Caches cos/sin for every position up to `max_positions`; `forward` looks up a batch's."""

    def __init__(self, head_dim: int, max_positions: int, rope: dict) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
        """cos/sin for the batch's positions, looked up once per forward pass."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return RopeAngles(cos, sin)


@dataclass(frozen=True)
class RopeAngles:
    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]
        cos, sin = self.cos, self.sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
