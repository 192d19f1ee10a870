"""Load a Hugging Face checkpoint (a directory or a hub id, `hub.checkpoint_dir`) into the
shared decoder.

What the checkpoint is (config, tokenizer, identity) comes from `info.describe_model`, which
refuses anything that is not a supported architecture; the weights come from
`model.safetensors` or a sharded set (`model.safetensors.index.json`) and must match the
decoder's parameters exactly. A tensor-parallel rank (`tp`) reads only its shard of each
weight (`TPShard.load`, the Megatron split); the last rank's vocabulary padding is zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from cluster.config import ModelConfig
from cluster.errors import InvalidArgument
from cluster.model.decoder import CausalLM
from cluster.model.hub import checkpoint_dir, weight_files
from cluster.model.info import ArchSpec, ModelInfo, describe_model
from cluster.model.linear import pack_linears
from cluster.model.parallel.group import SINGLE, TPGroup
from cluster.model.parallel.shard import TPShard
from cluster.model.rope import RotaryEmbedding


def load_model(config: ModelConfig, tp: TPGroup = SINGLE) -> LoadedModel:
    config = config.on_device()
    info = describe_model(config)  # refuses an unsupported checkpoint before any weights
    files = weight_files(checkpoint_dir(config))  # a hub id's download, on this replica's node
    spec = info.spec
    device = torch.device(config.device)
    with torch.device("meta"):
        model = CausalLM(spec, tp)
    model = model.to_empty(device=device)
    # to_empty left the rope tables uninitialised; they are computed, not loaded.
    rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope)
    model.rotary = rotary.to(device)
    if spec.tie_word_embeddings:  # to_empty gave lm_head its own storage; share it again
        model.lm_head.weight = model.model.embed_tokens.weight
    _load_weights(model, files, spec, model.shard, device)
    model = model.to(config.torch_dtype).eval()
    model.fuse_projections()
    if config.packed_weights:
        pack_linears(model)
    return LoadedModel(model=model, info=info)


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    info: ModelInfo


def _load_weights(
    model: CausalLM, files: list[Path], spec: ArchSpec, shard: TPShard, device
) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                if name not in params:
                    if name == "lm_head.weight" and spec.tie_word_embeddings:
                        continue
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    raise InvalidArgument(f"unexpected weight {name!r} in {f.name}")
                param = params[name]
                want = shard.full_shape(name, tuple(param.shape))
                if tuple(st.get_slice(name).get_shape()) != want:
                    raise InvalidArgument(
                        f"weight {name!r} has shape {tuple(st.get_slice(name).get_shape())}, "
                        f"expected {want}"
                    )
                tensor = shard.load(name, st.get_slice(name))
                with torch.no_grad():
                    param[: tensor.shape[0]].copy_(tensor.to(device=device, dtype=param.dtype))
                    param[tensor.shape[0] :].zero_()  # the last rank's vocabulary padding
                loaded.add(name)
    missing = set(params) - loaded
    if spec.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise InvalidArgument(f"checkpoint is missing weights: {sorted(missing)[:5]}")
