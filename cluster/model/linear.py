"""The model's linear layer: `nn.Linear`, plus a pre-packed weight for small fp32 batches.

On the CPU in fp32, `pack_linears` packs every layer's weight once into MKL's internal GEMM
layout (`csrc/packed_gemm.cpp`). `Linear.forward` uses the packed copy for the row counts where
it is faster than `at::linear`: decode batches of a few to a few dozen sequences. Single rows
(MKL's matrix-vector path is as fast) and prefill-sized batches use the plain weight. The packed
copy is extra memory, about as much again as the fp32 weights (547 MB beside the `small`
preset's 538 MB).

A packed weight is a snapshot: the model's weights must not change after packing.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.native import load_extension

log = logging.getLogger("ray.serve." + __name__)

# Rows for which the packed GEMM beats at::linear over every linear layer of the `small`
# preset on 2 threads: a clear gain from 4 to 96 rows, none that held below or above (the
# figures are in docs/findings.md, with the commit that measured them).
PACKED_ROWS = range(4, 97)


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """One layer's weight in MKL's packed layout; `data` must stay at the address it was made."""

    data: torch.Tensor  # opaque fp32 buffer
    out_features: int
    in_features: int
    kernel: object

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # The kernel checks x's dtype, shape and the buffer's size before reading anything.
        return self.kernel.packed_linear(x, self.data, self.out_features, self.in_features, bias)


class Linear(nn.Linear):
    packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.shape[0] in PACKED_ROWS:
            return self.packed(x, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Pack the weight of every fp32 CPU `Linear` in `model`; returns how many were packed
    (0 where the packed GEMM is unavailable)."""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, Linear)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
    ]
    kernel = load_packed_gemm() if layers else None
    if kernel is None:
        return 0
    with torch.no_grad():
        for m in layers:
            m.packed = PackedWeight(
                kernel.pack_weight(m.weight), m.out_features, m.in_features, kernel
            )
    return len(layers)


@functools.cache
def load_packed_gemm() -> object | None:
    """The compiled packed-GEMM module, after checking that it computes what `at::linear` does
    for row counts on both sides of the packing hint; None (logged) otherwise."""
    kernel = load_extension("pdserve_packed_gemm", "packed_gemm.cpp")
    if kernel is None:
        return None
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=gen)
    b = torch.randn(40, generator=gen)
    packed = kernel.pack_weight(w)
    for rows in (1, PACKED_ROWS.start, 33, PACKED_ROWS.stop):
        x = torch.randn(rows, 24, generator=gen)
        for bias in (None, b):
            got = kernel.packed_linear(x, packed, 40, 24, bias)
            if not torch.allclose(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5):
                log.warning("packed GEMM disagrees with at::linear; using the plain path")
                return None
    return kernel
