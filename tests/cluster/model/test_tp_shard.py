"""The Megatron split: every rank loads only its slice of each weight, and the slices of all ranks
put back together are the checkpoint's weights (KV heads replicated where there are fewer of
them than ranks; the vocabulary padded on the last rank)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from cluster.config import ModelConfig
from cluster.errors import InvalidArgument
from cluster.model.info import describe_model
from cluster.model.loader import load_model
from cluster.model.parallel.shard import TPShard
from tests.conftest import TINY_SHAPE, build_checkpoint


class Rank:
    """Only a rank's coordinates: loading runs no collective."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def _spec(num_kv_heads: int = 2, vocab: int = 512):
    shape = {**TINY_SHAPE, "num_key_value_heads": num_kv_heads, "vocab_size": vocab}
    return type("Spec", (), {
        "num_heads": shape["num_attention_heads"], "num_kv_heads": num_kv_heads,
        "head_dim": shape["head_dim"], "intermediate_size": shape["intermediate_size"],
        "vocab_size": vocab,
    })  # fmt: skip


@pytest.mark.parametrize(
    ("kv", "k", "first_kv", "local_kv"),
    [(2, 2, [0, 1], 1), (2, 4, [0, 0, 1, 1], 1), (1, 2, [0, 0], 1), (4, 2, [0, 2], 2)],
)
def test_kv_heads_follow_the_query_heads(kv, k, first_kv, local_kv):
    shards = [TPShard.of(_spec(kv), r, k) for r in range(k)]
    assert [s.first_kv_head for s in shards] == first_kv
    assert {s.local_kv_heads for s in shards} == {local_kv}


def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(InvalidArgument):
        TPShard.of(_spec(2), 0, 3)  # 4 heads
    with pytest.raises(InvalidArgument):
        TPShard.of(_spec(3), 0, 2)  # 3 KV heads over 2 ranks


@pytest.mark.parametrize("arch", ["qwen2", "llama-tied"])
def test_ranks_load_their_slices_and_the_slices_make_the_whole(arch, tmp_path):
    # 4 ranks over 2 KV heads (replicated) and a vocabulary of 510 (padded to 4 x 128).
    path = build_checkpoint(arch, tmp_path, vocab_size=510)
    hf = load_file(str(path / "model.safetensors"))
    config = ModelConfig(str(path), packed_weights=False)
    ranks = [load_model(config, Rank(r, 4)).model for r in range(4)]
    d = TINY_SHAPE["head_dim"]

    def layer0(m, name):
        return dict(m.named_parameters())[name]

    embed = torch.cat([m.model.embed_tokens.weight for m in ranks])
    assert embed.shape[0] == 512 and torch.equal(embed[:510], hf["model.embed_tokens.weight"])
    assert not embed[510:].any()  # padding rows are zero
    lm = torch.cat([m.lm_head.weight for m in ranks])[:510]
    want_lm = hf["model.embed_tokens.weight" if arch == "llama-tied" else "lm_head.weight"]
    assert torch.equal(lm, want_lm)
    qkv = [layer0(m, "model.layers.0.self_attn.qkv_proj.weight") for m in ranks]
    q = torch.cat([w[:d] for w in qkv])  # one query head per rank
    assert torch.equal(q, hf["model.layers.0.self_attn.q_proj.weight"])
    k_full = hf["model.layers.0.self_attn.k_proj.weight"]
    for r, w in enumerate(qkv):  # KV head r // 2 on rank r
        assert torch.equal(w[d : 2 * d], k_full[(r // 2) * d : (r // 2 + 1) * d])
    o = torch.cat([m.model.layers[0].self_attn.o_proj.weight for m in ranks], dim=1)
    assert torch.equal(o, hf["model.layers.0.self_attn.o_proj.weight"])
    down = torch.cat([m.model.layers[0].mlp.down_proj.weight for m in ranks], dim=1)
    assert torch.equal(down, hf["model.layers.0.mlp.down_proj.weight"])
    if arch == "qwen2":  # the QKV bias is split with its rows
        b = torch.cat([layer0(m, "model.layers.0.self_attn.qkv_proj.bias")[:d] for m in ranks])
        assert torch.equal(b, hf["model.layers.0.self_attn.q_proj.bias"])


def test_tp1_builds_the_plain_layers(model_dir):
    spec = describe_model(ModelConfig(str(model_dir("llama-gqa")))).spec
    shard = TPShard.of(spec)
    assert (shard.local_heads, shard.local_kv_heads, shard.local_vocab) == (4, 2, 512)
    model = load_model(ModelConfig(str(model_dir("llama-gqa")))).model
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    assert type(model.model.layers[0].self_attn.o_proj).__name__ == "Linear"
    assert type(model.lm_head).__name__ == "Linear"
