"""`RMSNorm`, the Llama family's normalization, under Hugging Face's attribute names (`weight`,
and `eps` from the config's `rms_norm_eps`). The decoder runs it through its kernel set:
eagerly (`decoder.EagerKernels`) or fused with the residual add (`triton_fused`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's order: normalise in fp32, cast back, then scale; one fused op instead of six.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
