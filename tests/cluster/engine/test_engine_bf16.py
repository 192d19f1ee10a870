"""The engine in bfloat16, on the CPU and (behind the `gpu` marker) on CUDA.

Exact token equality is the fp32 contract (test_engine_oracle.py). In bf16 two correct
implementations round differently, and on a random-weight model a near-tie flips within a few
steps, after which the two continuations are unrelated. So the bf16 oracle is teacher-forced:
transformers, in the same dtype on the same device, reads the engine's own output in one forward
pass, and at every generated step the engine's token must be transformers' argmax up to bf16
rounding (its logit within `BF16_LOGIT_TOLERANCE` of the maximum). A wrong engine (a lost bias,
a rotated-by-the-wrong-angle key, a stale KV block) picks tokens whose logits sit far below the
maximum and fails at once; `test_teacher_forced_check_rejects_a_wrong_output` shows the check
is not vacuous. The KV path (export -> import into a second engine -> continue) must be exact:
both engines run the same kernels on the same data.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.request import Request
from tests.conftest import ARCHS, drive, greedy, prefill, prompt, run_to_completion
from tests.engine_kv import export_kv, import_kv

NEW_TOKENS = 16
PROMPT_LENS = (3, 17, 40)  # one block, several blocks, and longer than the sliding window
# Largest gap allowed between the engine token's logit and the maximum logit (bf16 keeps 8
# significant bits; the tiny models' logits are O(1), so one rounding is ~0.01 and a 2-layer
# model accumulates a few).
BF16_LOGIT_TOLERANCE = 0.1

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]

_oracles: dict[tuple[str, str], torch.nn.Module] = {}


def oracle(path: Path, device: str) -> torch.nn.Module:
    key = (str(path), device)
    if key not in _oracles:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        _oracles[key] = model.to(device).eval()
    return _oracles[key]


@torch.inference_mode()
def logit_gaps(path: Path, device: str, prompt_ids, tokens: list[int]) -> list[float]:
    """Per generated step: max logit minus the logit of the token the engine chose, from one
    bf16 transformers forward over prompt + output."""
    ids = torch.tensor([[*prompt_ids, *tokens]], device=device)
    logits = oracle(path, device)(ids).logits[0].float()  # [len, vocab]
    steps = logits[len(prompt_ids) - 1 : -1]  # the logits that chose each output token
    chosen = steps.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
    return (steps.max(dim=1).values - chosen).tolist()


def assert_argmax_up_to_rounding(path: Path, device: str, prompt_ids, tokens: list[int]) -> None:
    gaps = logit_gaps(path, device, prompt_ids, tokens)
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[worst] <= BF16_LOGIT_TOLERANCE, (
        f"step {worst}: the engine's token {tokens[worst]} is {gaps[worst]:.3f} below "
        f"transformers' maximum logit (bf16 tolerance {BF16_LOGIT_TOLERANCE}); tokens {tokens}"
    )


def _requests() -> list[Request]:
    return [Request(f"r{n}", prompt(n, seed=n), greedy(NEW_TOKENS)) for n in PROMPT_LENS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_engine_is_greedy_up_to_rounding(arch, device, model_dir, make_engine):
    """A batch of mixed lengths with chunked prefill (budget 8, blocks of 4)."""
    path = model_dir(arch)
    engine = make_engine(
        path, device=device, dtype="bfloat16", block_size=4, max_num_batched_tokens=8
    )
    assert engine.kv_cache.k.dtype == torch.bfloat16
    assert engine.kv_cache.k.device.type == device
    requests = _requests()
    outputs = run_to_completion(engine, requests)
    for r in requests:
        out = outputs[r.request_id]
        assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS
        assert_argmax_up_to_rounding(path, device, r.prompt_token_ids, out.token_ids)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_export_import_continues_exactly(device, model_dir, make_engine):
    """Prefill on one bf16 engine, export, import into another, decode: the tokens equal an
    uninterrupted run on a third engine, bit for bit, and the KV moved is bf16."""
    path = model_dir("llama-gqa")
    kw = dict(device=device, dtype="bfloat16", block_size=4)
    a = make_engine(path, **kw)
    b = make_engine(path, num_blocks=64, **kw)
    whole = make_engine(path, **kw)
    ids, params = prompt(23, seed=23), greedy(NEW_TOKENS)

    first = prefill(a, Request("r", ids, params, prefill_only=True))
    kv = export_kv(a, "r")
    assert kv.k.dtype == torch.bfloat16 and kv.num_tokens == len(ids)
    import_kv(b, Request("r", ids, params), kv, first)
    tokens = [first, *drive(b)["r"].token_ids]
    assert a.release("r")

    want = run_to_completion(whole, [Request("r", ids, params)])["r"].token_ids
    assert tokens == want
    assert_argmax_up_to_rounding(path, device, ids, tokens)


def test_teacher_forced_check_rejects_a_wrong_output(model_dir, make_engine):
    """The bf16 check is not vacuous: a token replaced by a clearly worse one fails it."""
    path = model_dir("llama-gqa")
    engine = make_engine(path, dtype="bfloat16", block_size=4)
    ids = prompt(17, seed=17)
    tokens = run_to_completion(engine, [Request("r", ids, greedy(NEW_TOKENS))])["r"].token_ids
    assert_argmax_up_to_rounding(path, "cpu", ids, tokens)
    with torch.inference_mode():
        full = torch.tensor([[*ids, *tokens]])
        step_logits = oracle(path, "cpu")(full).logits[0, len(ids) + 4].float()
    wrong = list(tokens)
    wrong[5] = int(step_logits.argmin())  # the least likely token at step 5
    with pytest.raises(AssertionError, match="step 5"):
        assert_argmax_up_to_rounding(path, "cpu", ids, wrong)
