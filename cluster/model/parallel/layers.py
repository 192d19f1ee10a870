"""The layers whose outputs cross ranks (built only at TP > 1; TP 1 uses plain `Linear` and
`nn.Embedding`). Column-parallel layers need no class of their own: a rank's q/k/v or gate/up
projection is an ordinary `Linear` over its rows of the weight, with no communication.

- `RowParallelLinear` (o_proj, down_proj): each rank multiplies its slice of the input features
  by its columns of the weight; one all-reduce sums the partial products, then the bias (whole on
  every rank) is added once.
- `VocabParallelEmbedding`: each rank looks up the ids in its vocabulary rows, zeros for the
  others; one all-reduce assembles every row.
- `ParallelLMHead`: each rank scores its vocabulary rows; an all-gather puts the scores side by
  side and the padding past the real vocabulary is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.linear import PACKED_ROWS, Linear
from cluster.model.parallel.group import TPGroup
from cluster.model.parallel.shard import TPShard


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.shape[0] in PACKED_ROWS:
            y = self.packed(x, None)
        else:
            y = F.linear(x, self.weight)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """`weight` is this rank's `[local_vocab, hidden]` rows (HF's `embed_tokens.weight`)."""

    def __init__(self, shard: TPShard, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.local_vocab, hidden_size))
        self.start, self.tp = shard.vocab_start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(mine, local, 0), self.weight)
        x = torch.where(mine.unsqueeze(-1), x, 0.0)
        return self.tp.all_reduce(x)


class ParallelLMHead(Linear):
    """This rank's `[local_vocab, hidden]` rows of the LM head; `forward` returns the whole
    vocabulary's scores on every rank."""

    def __init__(self, shard: TPShard, hidden_size: int, tp: TPGroup) -> None:
        super().__init__(hidden_size, shard.local_vocab, bias=False)
        self.vocab_size, self.tp = shard.vocab_size, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab]
        return self.tp.all_gather(super().forward(x))[..., : self.vocab_size]
