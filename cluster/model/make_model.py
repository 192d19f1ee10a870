"""Deterministic random-weight Llama checkpoints in Hugging Face format, for tests and demos.

`make_model(preset, out_dir, seed)` writes config.json, generation_config.json,
model.safetensors and tokenizer files; the same preset and seed give byte-identical files on the
same software stack. `device="cuda"` draws the weights on the GPU instead (seconds for the `1b`
preset, where the CPU's float64 draw takes minutes); those bytes depend on the GPU's generator.
Checkpoints appear atomically: they are written into a temporary directory beside `out_dir` and
renamed into place, so a reader sees either nothing or a whole checkpoint.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from cluster.errors import InvalidArgument
from cluster.model.tokenizer_factory import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END_TOKEN,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    write_tokenizer,
)

# Bump when the files make_model writes change, so stale cached checkpoints are not reused.
FORMAT_VERSION = "v1"
_BOS_ID = SPECIAL_TOKENS.index(BOS_TOKEN)
_EOS_ID = SPECIAL_TOKENS.index(EOS_TOKEN)
_IM_END_ID = SPECIAL_TOKENS.index(IM_END_TOKEN)


@dataclass(frozen=True)
class ModelPreset:
    """The shape of a Llama-architecture model; field names follow the HF LlamaConfig."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise InvalidArgument("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise InvalidArgument(f"vocab_size must be >= {MIN_VOCAB_SIZE}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor in model.safetensors, named as HF LlamaForCausalLM names it, in order."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, h)
        return shapes

    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.weight_shapes().values())

    def hf_config(self) -> dict[str, object]:
        """config.json. rope_theta appears both flat (transformers 4) and in rope_parameters (5)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": _BOS_ID,
            "eos_token_id": _EOS_ID,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mlp_bias": False,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }


PRESETS: dict[str, ModelPreset] = {
    # ~5.2M parameters; untied lm_head, so the tied path is covered by `small` only.
    "tiny": ModelPreset(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    # ~1.24B parameters, shaped like Llama-3.2-1B (its default RoPE, a shorter context): for
    # GPU benchmarks, where the weight-read floor of a decode step is large enough to measure.
    "1b": ModelPreset(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    # ~134.5M parameters, shaped like SmolLM-135M.
    "small": ModelPreset(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
}


def make_model(preset: str, out_dir: str | Path, seed: int = 0, device: str = "cpu") -> Path:
    """Write a checkpoint for `preset` into `out_dir` (which must be absent or empty), its
    weights drawn on `device`.

    Raises InvalidArgument for an unknown preset and FileExistsError when `out_dir` already has
    contents, including when a concurrent call finished first.
    """
    if preset not in PRESETS:
        raise InvalidArgument(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise FileExistsError(errno.EEXIST, "directory not empty", str(out))  # fail before work
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_checkpoint(spec, tmp, seed, torch.device(device))
        for path in tmp.iterdir():
            path.chmod(0o644)  # save_file writes 0o600
        tmp.chmod(0o755)  # mkdtemp makes it 0o700
        try:
            os.rename(tmp, out)  # atomic; replaces an empty directory, refuses a non-empty one
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(errno.EEXIST, "directory not empty", str(out)) from e
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def cache_dir(preset: str) -> Path:
    """Where the cache keeps `preset`'s seed-0 checkpoint (the one home of that path):
    `<root>/models/<preset>-<FORMAT_VERSION>`, root $PDSERVE_CACHE if set, else ~/.cache/pdserve."""
    root = os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve"
    return Path(root).expanduser().absolute() / "models" / f"{preset}-{FORMAT_VERSION}"


def cached_model(preset: str = "tiny") -> Path:
    """`preset`'s seed-0 checkpoint in the cache, built on first use; safe across processes.
    The `1b` preset's weights are drawn on the GPU when there is one (`make_model`)."""
    out = cache_dir(preset)
    if _is_checkpoint(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not _is_checkpoint(out):
            try:
                make_model(preset, out, seed=0, device=_draw_device(preset))
            except FileExistsError:  # built by a process that does not share our lock
                pass
    return out


def _draw_device(preset: str) -> str:
    big = PRESETS.get(preset) is not None and PRESETS[preset].num_parameters() > 500_000_000
    return "cuda" if big and torch.cuda.is_available() else "cpu"


def default_model_dir() -> Path:
    """The `tiny` checkpoint the demo and the CLI serve when no model is given."""
    return cached_model("tiny")


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def _write_checkpoint(spec: ModelPreset, out: Path, seed: int, device: torch.device) -> None:
    _write_json(out / "config.json", spec.hf_config())
    generation = {
        "bos_token_id": _BOS_ID,
        "eos_token_id": [_EOS_ID, _IM_END_ID],
        "pad_token_id": _EOS_ID,
    }
    _write_json(out / "generation_config.json", generation)
    weights = _random_weights(spec, seed, device)
    save_file(weights, str(out / "model.safetensors"), {"format": "pt"})
    write_tokenizer(out, spec.vocab_size, spec.max_position_embeddings)


def _random_weights(
    spec: ModelPreset, seed: int, device: torch.device, draw: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """normal(0, initializer_range) for matrices, ones for norms, drawn in weight_shapes order.

    On the CPU sampled in float64 (`draw`'s default there) and rounded to float32: torch's
    float32 CPU sampler has a vectorised path chosen by CPU features, the float64 one does not,
    so the bytes do not depend on it. On another device sampled there in float32 (fast; the
    bytes are the device's).
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    if draw is None:
        draw = torch.float64 if device.type == "cpu" else torch.float32
    weights = {}
    for name, shape in spec.weight_shapes().items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, dtype=torch.float32)
        else:
            w = torch.empty(shape, dtype=draw, device=device)
            w.normal_(0.0, spec.initializer_range, generator=generator)
            weights[name] = w.to(torch.float32).cpu()
    return weights


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", "utf-8")
