"""Tensor parallelism inside one replica: the communication seam every rank talks through
(`group`: rank, world size, all-reduce, all-gather, a bytes broadcast, each with a timeout;
`SINGLE` at TP 1, which runs no collective at all), which slice of each checkpoint weight a rank
owns (`shard`, the Megatron split: attention heads and the MLP's intermediate columns, KV heads
replicated where a model has fewer than the TP size, the vocabulary), and the layers whose
output crosses ranks (`layers`: row-parallel linear, vocabulary-parallel embedding and LM head).

Part of the model plane: imports the `cluster` root and `cluster.model` only.
"""

from cluster.model.parallel.group import SINGLE, TorchGroup, TPGroup
from cluster.model.parallel.shard import TPShard

__all__ = ["SINGLE", "TPGroup", "TPShard", "TorchGroup"]
