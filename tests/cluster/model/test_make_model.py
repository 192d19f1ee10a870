from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cluster.errors import InvalidArgument
from cluster.model.make_model import (
    FORMAT_VERSION,
    PRESETS,
    _random_weights,
    default_model_dir,
    make_model,
)
from cluster.model.tokenizer_factory import SPECIAL_TOKENS, _top_up, build_tokenizer

TEXT = "Hello, wörld! 你好"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny: Path) -> transformers.PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny)


def test_tiny_loads_in_transformers(tiny: Path) -> None:
    config = AutoConfig.from_pretrained(tiny)
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    model, info = AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == PRESETS["tiny"].num_parameters()
    norm = model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert 0.015 < model.model.embed_tokens.weight.std().item() < 0.025


def test_tokenizer_matches_config(tiny: Path, tokenizer) -> None:
    config = AutoConfig.from_pretrained(tiny)
    assert len(tokenizer) == config.vocab_size == PRESETS["tiny"].vocab_size
    assert tokenizer.bos_token_id == config.bos_token_id
    assert tokenizer.eos_token_id == config.eos_token_id
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3]


def test_round_trip_and_every_id_decodes(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert all(isinstance(tokenizer.decode([i]), str) for i in range(len(tokenizer)))


def test_chat_template(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages[1:], tokenize=True, add_generation_prompt=False)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == 2 and ids[-2:] == [3, tokenizer.encode("\n")[0]]


def test_same_seed_same_bytes_other_seed_differs(tiny: Path, tmp_path: Path) -> None:
    again = make_model("tiny", tmp_path / "again", seed=0)
    other = make_model("tiny", tmp_path / "other", seed=1)
    names = sorted(p.name for p in tiny.iterdir())
    assert (
        names == sorted(p.name for p in again.iterdir()) == sorted(p.name for p in other.iterdir())
    )
    assert "lm_head.weight" not in names
    for name in names:
        assert (tiny / name).read_bytes() == (again / name).read_bytes(), name
    assert (tiny / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "other"]  # no temp dirs left


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("small", 125_000_000, 145_000_000), ("1b", 1_200_000_000, 1_300_000_000)],
)
def test_presets_match_hf_llama_on_meta_device(name: str, low: int, high: int) -> None:
    preset = PRESETS[name]
    assert low <= preset.num_parameters() <= high
    config = transformers.LlamaConfig.from_dict(preset.hf_config())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == preset.num_parameters()
    hf_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied lm_head deduped
    assert hf_shapes == preset.weight_shapes()


def test_tokenizer_is_deterministic_and_exact() -> None:
    a, b = build_tokenizer(1000), build_tokenizer(1000)
    assert a.to_str() == b.to_str() and a.get_vocab_size() == 1000


def test_top_up_fills_with_valid_merges() -> None:
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, "a", "b"])}
    merges: list[tuple[str, str]] = []
    _top_up(vocab, merges, 12)
    assert sorted(vocab.values()) == list(range(12))
    assert all(a in vocab and b in vocab and a + b in vocab for a, b in merges)


def test_refuses_unknown_preset_and_nonempty_dir(tiny: Path) -> None:
    with pytest.raises(InvalidArgument):
        make_model("huge", tiny.parent / "x")
    with pytest.raises(FileExistsError):
        make_model("tiny", tiny)


def test_default_model_dir_uses_cache_env_and_is_race_safe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(default_model_dir())) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = tmp_path / "models" / f"tiny-{FORMAT_VERSION}"
    assert results == [expected] * 3
    assert AutoConfig.from_pretrained(expected).vocab_size == PRESETS["tiny"].vocab_size
    mtime = (expected / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == expected
    assert (expected / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in expected.parent.iterdir() if p.is_dir()) == [expected.name]


def test_the_device_draw_gives_the_same_tensors_in_float32() -> None:
    """The GPU's float32 draw (run here on the CPU) gives the exact draw's names, shapes and
    dtypes, and the same spread; the bytes differ (another sampler)."""
    preset = PRESETS["tiny"]
    exact = _random_weights(preset, 0, torch.device("cpu"))
    fast = _random_weights(preset, 0, torch.device("cpu"), torch.float32)
    assert {n: (w.shape, w.dtype) for n, w in fast.items()} == {
        n: (w.shape, w.dtype) for n, w in exact.items()
    }
    name = "model.layers.0.mlp.up_proj.weight"
    assert abs(fast[name].std().item() - preset.initializer_range) < 1e-3
    assert not torch.equal(fast[name], exact[name])
