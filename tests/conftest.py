"""Shared factories: tiny random-weight HF checkpoints, engines that must not leak KV blocks, and
the transformers greedy oracle the engine is proven against."""

from __future__ import annotations

import os

# Without a GPU, Triton kernels run under Triton's interpreter, on CPU tensors. Triton reads this
# when it is first imported (transformers may import it below), so it is set before anything.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import shutil  # noqa: E402
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.model.make_model import make_model
from cluster.request import Request, RequestOutput
from cluster.sampling_params import SamplingParams
from tests.engine_kv import export_kv, import_kv

# The models are tiny: with more than one thread, thread synchronisation costs more than it
# saves, and far more on a loaded machine.
# One Ray + Serve per session, started lazily. A machine without Ray Serve (the lent GPU machine,
# which runs only the `gpu`-marked engine tests) gets no Ray fixtures rather than no tests.
try:
    import ray.serve  # noqa: F401  (the fixtures import it anyway)
except ImportError:
    pytest_plugins = []
else:
    pytest_plugins = ["tests.ray_fixtures"]

torch.set_num_threads(1)

# Shape shared by every tiny checkpoint; max_position_embeddings bounds the context.
TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    # Wide enough init that logits are well separated (near-ties are rare).
    initializer_range=0.1,
    # No EOS: `ignore_eos` runs and HF's `min_new_tokens` then agree on every step.
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
SLIDING_WINDOW = 16

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the rescaling touches the frequencies a 64-token context actually uses.
    "original_max_position_embeddings": 32,
}

# arch name -> (config class, model class, extra config fields)
ARCHS: dict[str, tuple[type, type[PreTrainedModel], dict]] = {
    "llama-gqa": (LlamaConfig, LlamaForCausalLM, {}),
    "llama-tied": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama3-rope": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": _LLAMA3_ROPE}),
    # transformers applies the window (eager and sdpa alike); test_variant_config_matters
    # checks that it changes the output of a 40-token prompt.
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": SLIDING_WINDOW}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
}


def build_checkpoint(arch: str, out: Path, seed: int = 0, **shape) -> Path:
    """Save a random-weight `arch` checkpoint with transformers' own classes; `shape` overrides
    fields of TINY_SHAPE."""
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**{**TINY_SHAPE, **shape}, **extra, architectures=[model_cls.__name__])
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # RMSNorm weights (incl. Qwen3's q_norm / k_norm) away from all-ones.
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                # Qwen2's QKV bias is zero-initialised; make it matter.
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight") and config.tie_word_embeddings:
                # Tied, the input embedding dominates the logits and greedy output just
                # repeats the last token; a smaller embedding gives varied output.
                p.mul_(0.3)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Callable[[str], Path]:
    """`model_dir(arch)`: a cached tiny checkpoint directory for one of `ARCHS`."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = build_checkpoint(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    """The config of an architecture the engine does not support (refused before weights)."""
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=128, n_positions=64)
    config.architectures = ["GPT2LMHeadModel"]
    out = tmp_path_factory.mktemp("gpt2")
    config.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer_model_dir(tmp_path_factory) -> Path:
    """`make_model`'s `tiny` preset: a checkpoint with a real (byte-level BPE) tokenizer."""
    return make_model("tiny", tmp_path_factory.mktemp("tokenizer") / "tiny")


def with_eos(src: Path, out: Path, eos_token_id: int) -> Path:
    """A copy of checkpoint `src` whose config names `eos_token_id` as EOS."""
    shutil.copytree(src, out)
    for name in ("config.json", "generation_config.json"):
        f = out / name
        if f.is_file():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = eos_token_id
            f.write_text(json.dumps(cfg))
    return out


# -- engines ------------------------------------------------------------------------------


def engine_config(path: str | Path, **overrides) -> EngineConfig:
    """An EngineConfig for `path`; each keyword goes to the config slice that has that field
    (e.g. block_size / num_blocks to CacheConfig, max_num_batched_tokens to SchedulerConfig)."""
    slices: dict[type, dict] = {ModelConfig: {}, CacheConfig: {}, SchedulerConfig: {}}
    top: dict = {}
    for key, value in overrides.items():
        owner = next((c for c in slices if key in {f.name for f in fields(c)}), None)
        if owner is not None:
            slices[owner][key] = value
        elif key in {f.name for f in fields(EngineConfig)}:
            top[key] = value
        else:
            raise TypeError(f"unknown engine setting {key!r}")
    return EngineConfig(
        ModelConfig(str(path), **slices[ModelConfig]),
        CacheConfig(**slices[CacheConfig]),
        SchedulerConfig(**slices[SchedulerConfig]),
        **top,
    )


@pytest.fixture
def make_engine(request) -> Iterator[Callable[..., Engine]]:
    """`make_engine(path, **overrides)`. After the test, asserts every engine it built has all
    its KV blocks free again (nothing leaked); skipped when the test itself already failed."""
    engines: list[Engine] = []

    def make(path: str | Path, **overrides) -> Engine:
        engine = Engine(engine_config(path, **overrides))
        engines.append(engine)
        return engine

    yield make
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        return
    for engine in engines:
        assert engine.stats().kv_blocks_used == 0, "KV blocks leaked"
        blocks = engine.scheduler.blocks
        assert blocks.num_free == blocks.num_blocks, "KV blocks leaked"


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def prompt(length: int, seed: int, vocab: int = TINY_SHAPE["vocab_size"]) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (length,), generator=gen).tolist())


def step_into(engine: Engine, results: dict[str, RequestOutput]) -> None:
    """One engine step, its outputs gathered into `results` by request id."""
    for out in engine.step():
        results.setdefault(out.request_id, RequestOutput(out.request_id)).add(out)


def drive(
    engine: Engine, results: dict[str, RequestOutput] | None = None, max_steps: int = 2000
) -> dict[str, RequestOutput]:
    """Step `engine` until it has no work; what each request gained, by id. Fails instead of
    hanging if the engine makes no end."""
    results = {} if results is None else results
    for _ in range(max_steps):
        if not engine.has_work():
            return results
        step_into(engine, results)
    raise AssertionError(f"engine still has work after {max_steps} steps: {engine.stats()}")


def run_to_completion(engine: Engine, requests: list[Request]) -> dict[str, RequestOutput]:
    """Queue all `requests` at once and drive `engine` until they finish."""
    for r in requests:
        engine.add_request(r)
    return drive(engine)


def prefill(engine, request: Request) -> int:
    """Run a `prefill_only` request on `engine` until it is held; its first token."""
    assert request.prefill_only
    engine.add_request(request)
    results = drive(engine)
    out = results[request.request_id]
    assert out.finish_reason == "prefilled"
    assert len(out.token_ids) == 1
    return out.token_ids[0]


def disaggregated(prefill_engine, decode_engine, rid, prompt_ids, params) -> list[int]:
    """Prefill on one engine, decode on the other; all output tokens. Releases the export."""
    first = prefill(prefill_engine, Request(rid, prompt_ids, params, prefill_only=True))
    kv = export_kv(prefill_engine, rid)
    import_kv(decode_engine, Request(rid, prompt_ids, params), kv, first)
    out = drive(decode_engine)[rid]
    assert prefill_engine.release(rid)
    return [first, *out.token_ids]


@dataclass(frozen=True)
class Plan:
    """A snapshot of one `Scheduler.schedule()` result, taken before the step changes state."""

    scheduled: list[tuple[str, int, int]]  # (request id, start, num_tokens)
    preempted: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.scheduled)


def record_plans(engine: Engine) -> list[Plan]:
    """Record every plan `engine`'s scheduler makes from now on."""
    plans: list[Plan] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        plans.append(
            Plan(
                [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled],
                [s.request_id for s in out.preempted],
            )
        )
        return out

    engine.scheduler.schedule = recording_schedule
    return plans


# -- the transformers oracle -----------------------------------------------------------------

# Where fp32 rounding can flip a near-tie between the engine and transformers, a divergence is
# accepted only at a step whose top-two logit margin (per the HF model) is below this; the
# comparison then covers the prefix up to that step. See ARCHITECTURE.md section 7.
NEAR_TIE_MARGIN = 1e-4


@dataclass(frozen=True)
class OracleRun:
    tokens: list[int]
    logits: list[torch.Tensor]  # [vocab] raw logits at each generated step


class HFOracle:
    def __init__(self) -> None:
        self._models: dict[str, PreTrainedModel] = {}
        self._runs: dict[tuple[str, tuple[int, ...], int], OracleRun] = {}

    def model(self, path: str | Path) -> PreTrainedModel:
        key = str(path)
        if key not in self._models:
            model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
            self._models[key] = model.eval()
        return self._models[key]

    def run(self, path: str | Path, prompt_ids, max_new_tokens: int) -> OracleRun:
        key = (str(path), tuple(prompt_ids), max_new_tokens)
        if key not in self._runs:
            self._runs[key] = self._generate(path, prompt_ids, max_new_tokens)
        return self._runs[key]

    @torch.inference_mode()
    def _generate(self, path: str | Path, prompt_ids, max_new_tokens: int) -> OracleRun:
        ids = torch.tensor([list(prompt_ids)])
        out = self.model(path).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        assert len(tokens) == max_new_tokens
        return OracleRun(tokens, [step[0].float() for step in out.logits])

    def greedy(self, path: str | Path, prompt_ids, max_new_tokens: int) -> list[int]:
        return self.run(path, prompt_ids, max_new_tokens).tokens

    def assert_greedy(self, path: str | Path, prompt_ids, got: list[int], n: int) -> None:
        """`got` must be `n` tokens equal to HF greedy decoding token for token. A divergence is
        tolerated only at a near-tie step (top-two margin < NEAR_TIE_MARGIN) and only to the
        runner-up token; the tokens before it must match."""
        assert len(got) == n, f"expected {n} tokens, got {len(got)}: {got}"
        want = self.run(path, prompt_ids, n)
        if got == want.tokens:
            return
        i = next(i for i, (a, b) in enumerate(zip(got, want.tokens, strict=True)) if a != b)
        top2 = want.logits[i].topk(2)
        margin = float(top2.values[0] - top2.values[1])
        assert margin < NEAR_TIE_MARGIN and got[i] in top2.indices.tolist(), (
            f"diverged from transformers at step {i}: got {got[i]}, want {want.tokens[i]} "
            f"(top-2 margin {margin:.3g}); got {got}, want {want.tokens}"
        )


@pytest.fixture(scope="session")
def hf() -> HFOracle:
    return HFOracle()


@pytest.fixture(scope="session")
def hf_greedy(hf: HFOracle) -> Callable[[str | Path, tuple[int, ...], int], list[int]]:
    """`hf_greedy(model_dir, prompt_ids, max_new_tokens)`: transformers' greedy tokens."""
    return hf.greedy


# -- hooks ------------------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def pytest_collection_modifyitems(config, items) -> None:
    """Every test that starts Ray (through the `ray_serve` fixture) is `slow`, so
    `pytest -m "not slow"` is the fast subset; `gpu` tests skip without CUDA."""
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "ray_serve" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
