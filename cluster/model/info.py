"""What a checkpoint is, without its weights: `describe_model` reads a Hugging Face checkpoint
directory's config (`ArchSpec`), tokenizer, EOS ids and identity into a `ModelInfo`, enough for
a router to validate requests. Imports no model code (no decoder, layers or kernels), so the
router can use it; `loader` builds the decoder from the same description.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from cluster.config import ModelConfig
from cluster.errors import InvalidArgument
from cluster.model.hub import checkpoint_dir, is_hub_id, weight_files
from cluster.sampling_params import SamplingParams

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ArchSpec:
    """The shape of a Llama-family decoder and its per-architecture switches (see `decoder`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None


def arch_spec(hf_config) -> ArchSpec:
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = archs[0] if archs else ""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise InvalidArgument(
            f"unsupported architecture {arch or '(none)'!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or dict(getattr(c, "rope_scaling", None) or {})
    rope = {"rope_theta": getattr(c, "rope_theta", 10000.0), **rope}
    bias = bool(getattr(c, "attention_bias", False))
    window = getattr(c, "sliding_window", None)
    if arch.startswith("Qwen") and not getattr(c, "use_sliding_window", False):
        window = None
    return ArchSpec(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope=rope,
        qkv_bias=True if arch == "Qwen2ForCausalLM" else bias,
        o_bias=False if arch == "Qwen2ForCausalLM" else bias,
        mlp_bias=bool(getattr(c, "mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        sliding_window=window,
    )


@dataclass(frozen=True)
class ModelInfo:
    """What a checkpoint is, without its weights: enough for a router to validate requests."""

    spec: ArchSpec
    tokenizer: PreTrainedTokenizerBase | None
    model_id: str  # name@identity: a hub id's commit, or a digest of config and weight headers
    eos_token_ids: frozenset[int]
    max_model_len: int
    # The sampling settings of the checkpoint's generation_config.json (`generation_defaults`)
    sampling_defaults: tuple[tuple[str, float], ...] = ()

    def check_request(self, ids: tuple[int, ...] | list[int], params: SamplingParams) -> None:
        """Refuse, naming the field, a prompt or parameters this model cannot serve. The router
        runs this before any worker is touched; the engine runs it again on admission.

        The prompt and `max_tokens` must fit the context together (`prompt + max_tokens <=
        max_model_len`): a request that asks for more is refused, never silently cut short.
        One that leaves `max_tokens` to the server gets `default_max_tokens`, which fits."""
        if not ids:
            raise InvalidArgument("prompt is empty", param="prompt")
        context, prompt, completion = self.max_model_len, len(ids), params.max_tokens
        if prompt >= context:
            raise InvalidArgument(
                f"this model's context is {context} tokens, and the prompt has {prompt}: "
                "it must leave room for at least one generated token",
                param="prompt",
            )
        vocab = self.spec.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(
                f"prompt_token_ids out of vocabulary [0, {vocab}): {bad[:5]}",
                param="prompt_token_ids",
            )
        if prompt + completion > context:
            raise InvalidArgument(
                f"this model's context is {context} tokens, but the request needs "
                f"{prompt + completion} ({prompt} in the prompt + {completion} max_tokens); "
                f"lower max_tokens to at most {context - prompt} or shorten the prompt",
                param="max_tokens",
            )
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop strings need a tokenizer; this model has none", "stop")

    def default_max_tokens(self, ids: tuple[int, ...] | list[int], server_default: int) -> int:
        """`max_tokens` for a request that did not set it: the server's default, cut to what
        the context leaves after the prompt, so an omitted `max_tokens` never makes a long
        prompt fail (a prompt that fills the context is still refused by `check_request`)."""
        return max(1, min(server_default, self.max_model_len - len(ids)))


def describe_model(config: ModelConfig) -> ModelInfo:
    """What `config`'s checkpoint is (a directory, or a hub id through `hub.checkpoint_dir`).
    Raises InvalidArgument, one line, for anything that is not a supported checkpoint.

    A hub id needs its config and tokenizer files only, not its weights (a router, or the
    machine that builds the app, never downloads them); its identity is its commit, which
    fixes every file's content, where a directory's is a digest of its config and weight
    headers."""
    hub = is_hub_id(config.path)
    path = checkpoint_dir(config, weights=not hub)
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"{path} is not a Hugging Face checkpoint (no config.json)")
    hf_config = AutoConfig.from_pretrained(path)
    spec = arch_spec(hf_config)
    limit = config.max_model_len or spec.max_position_embeddings
    identity = path.name[:12] if hub else _digest(path, weight_files(path))
    return ModelInfo(
        spec=spec,
        tokenizer=_load_tokenizer(path),
        model_id=f"{config.path if hub else path.name}@{identity}",
        eos_token_ids=_eos_ids(hf_config, path),
        max_model_len=min(limit, spec.max_position_embeddings),
        sampling_defaults=generation_defaults(path),
    )


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(folder: Path) -> tuple[tuple[str, float], ...]:
    """The sampling settings `folder`'s generation_config.json names (as vLLM's
    `--generation-config auto` reads them): requests that leave one unset get it."""
    gen = folder / "generation_config.json"
    if not gen.is_file():
        return ()
    try:
        doc = json.loads(gen.read_text())
    except ValueError as e:
        raise InvalidArgument(f"{gen} is not JSON: {e}") from None
    return tuple(
        (k, doc[k])
        for k in SAMPLING_KEYS
        if isinstance(doc.get(k), int | float) and not isinstance(doc.get(k), bool)
    )


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    return AutoTokenizer.from_pretrained(path)


def _eos_ids(hf_config, path: Path) -> frozenset[int]:
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen = path / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(int(i) for i in src)
    return frozenset(ids)


def _digest(path: Path, files: list[Path]) -> str:
    """A cheap identity: config.json plus every weight file's safetensors header."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in files:
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(n))
    return h.hexdigest()[:12]
