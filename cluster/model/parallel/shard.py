"""Which part of the model one tensor-parallel rank owns: the Megatron split.

With `k` ranks, rank `r` holds
- query heads `[r * H/k, (r + 1) * H/k)`: its rows of q_proj (weight and bias) and the same
  columns of o_proj (row-parallel: the partial outputs are summed over ranks);
- its query heads' KV heads: `Hkv/k` of them where `Hkv >= k`; where a model has fewer KV heads
  than ranks (GQA with few groups, MQA), the one KV head its query heads read, so each KV head
  is replicated on `k/Hkv` ranks (as vLLM does). Its k_proj/v_proj rows and its KV cache hold
  only those heads;
- intermediate columns `[r * I/k, (r + 1) * I/k)`: rows of gate_proj and up_proj, columns of
  down_proj (row-parallel);
- vocabulary rows `[r * Vp, (r + 1) * Vp)` of the embedding and LM head, `Vp = ceil(V/k)`; the
  last rank's rows past `V` are padding (zero, never looked up, their logits dropped).
Norms (and Qwen3's per-head q/k norms) and row-parallel biases are whole on every rank.

`TPShard.load` reads only a rank's slice of each checkpoint tensor (safetensors' lazy slices),
so no rank ever holds a whole weight it does not own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.errors import InvalidArgument

# How each HF weight (by the end of its name) is split: along rows (dim 0), columns (dim 1), or
# not at all. The unit of the slice (heads, KV heads, intermediate, vocabulary) follows from it.
_SPLITS = {
    "q_proj.weight": ("rows", "heads"),
    "q_proj.bias": ("rows", "heads"),
    "k_proj.weight": ("rows", "kv_heads"),
    "k_proj.bias": ("rows", "kv_heads"),
    "v_proj.weight": ("rows", "kv_heads"),
    "v_proj.bias": ("rows", "kv_heads"),
    "o_proj.weight": ("cols", "heads"),
    "gate_proj.weight": ("rows", "intermediate"),
    "gate_proj.bias": ("rows", "intermediate"),
    "up_proj.weight": ("rows", "intermediate"),
    "up_proj.bias": ("rows", "intermediate"),
    "down_proj.weight": ("cols", "intermediate"),
    "embed_tokens.weight": ("rows", "vocab"),
    "lm_head.weight": ("rows", "vocab"),
}


@dataclass(frozen=True)
class TPShard:
    rank: int
    world_size: int
    num_heads: int  # the model's, all ranks together
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, spec, rank: int = 0, world_size: int = 1) -> TPShard:
        """The shard of rank `rank` of `world_size` for an `ArchSpec`; InvalidArgument where the
        model does not split that way."""
        k = world_size
        h, hkv, inter = spec.num_heads, spec.num_kv_heads, spec.intermediate_size
        if h % k or inter % k:
            raise InvalidArgument(
                f"tensor_parallel_size {k} must divide the attention heads ({h}) and the "
                f"intermediate size ({inter})"
            )
        if (hkv % k) if hkv >= k else (k % hkv):
            raise InvalidArgument(
                f"tensor_parallel_size {k} and the {hkv} KV heads: one must divide the other"
            )
        return cls(rank, k, h, hkv, spec.head_dim, inter, spec.vocab_size)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def first_kv_head(self) -> int:
        """The first KV head this rank holds (the KV head of its first query head)."""
        group = self.num_heads // self.num_kv_heads  # query heads per KV head
        return self.rank * self.local_heads // group

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.world_size

    @property
    def local_vocab(self) -> int:
        """Vocabulary rows per rank, padding included."""
        return -(-self.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab

    def span(self, unit: str) -> tuple[int, int]:
        """[start, stop) of this rank's part of the dimension a `unit` indexes."""
        d = self.head_dim
        if unit == "heads":
            n = self.local_heads * d
            return self.rank * n, (self.rank + 1) * n
        if unit == "kv_heads":
            start = self.first_kv_head * d
            return start, start + self.local_kv_heads * d
        if unit == "intermediate":
            n = self.local_intermediate
            return self.rank * n, (self.rank + 1) * n
        start = self.vocab_start
        return start, min(start + self.local_vocab, self.vocab_size)

    def load(self, name: str, tensor_slice) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name`, read through a safetensors slice
        (`safe_open(...).get_slice(name)`): only those bytes are read."""
        split = next((s for end, s in _SPLITS.items() if name.endswith(end)), None)
        if split is None or self.world_size == 1:
            return tensor_slice[:]
        axis, unit = split
        start, stop = self.span(unit)
        return tensor_slice[start:stop] if axis == "rows" else tensor_slice[:, start:stop]

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint's shape of weight `name`, of which this rank holds `local`."""
        split = next((s for end, s in _SPLITS.items() if name.endswith(end)), None)
        if split is None or self.world_size == 1:
            return local
        axis, unit = split
        d = self.head_dim
        full = {"heads": self.num_heads * d, "kv_heads": self.num_kv_heads * d,
                "intermediate": self.intermediate_size, "vocab": self.vocab_size}[unit]  # fmt: skip
        dim = 0 if axis == "rows" else 1
        return (*local[:dim], full, *local[dim + 1 :])
