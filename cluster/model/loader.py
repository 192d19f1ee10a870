"""Load a Hugging Face checkpoint (a directory or a hub id, `hub.checkpoint_dir`) into the
shared decoder.

What the checkpoint is (config, tokenizer, identity) comes from `info.describe_model`, which
refuses anything that is not a supported architecture; the weights come from
`model.safetensors` or a sharded set (`model.safetensors.index.json`) and must match the
decoder's parameters exactly.
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
from cluster.model.rope import RotaryEmbedding


def load_model(config: ModelConfig) -> LoadedModel:
    config = config.on_device()
    info = describe_model(config)  # refuses an unsupported checkpoint before any weights
    files = weight_files(checkpoint_dir(config))  # a hub id's download, on this replica's node
    spec = info.spec
    device = torch.device(config.device)
    with torch.device("meta"):
        model = CausalLM(spec)
    model = model.to_empty(device=device)
    # to_empty left the rope tables uninitialised; they are computed, not loaded.
    rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope)
    model.rotary = rotary.to(device)
    if spec.tie_word_embeddings:  # to_empty gave lm_head its own storage; share it again
        model.lm_head.weight = model.model.embed_tokens.weight
    _load_weights(model, files, spec, device)
    model = model.to(config.torch_dtype).eval()
    model.fuse_projections()
    if config.packed_weights:
        pack_linears(model)
    return LoadedModel(model=model, info=info)


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    info: ModelInfo


def _load_weights(model: CausalLM, files: list[Path], spec: ArchSpec, device) -> None:
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
                tensor = st.get_tensor(name)
                param = params[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise InvalidArgument(
                        f"weight {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor.to(device=device, dtype=param.dtype))
                loaded.add(name)
    missing = set(params) - loaded
    if spec.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise InvalidArgument(f"checkpoint is missing weights: {sorted(missing)[:5]}")
