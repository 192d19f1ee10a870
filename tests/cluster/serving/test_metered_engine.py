"""`MeteredEngine` counts each prefilled prompt's tokens and cached tokens once, on the engine
that prefilled it, equal to what the requests' own outputs report."""

from __future__ import annotations

from cluster.request import Request
from cluster.serving.metered_engine import MeteredEngine
from tests.conftest import disaggregated, engine_config, greedy, prompt, run_to_completion

BS = 4
ARCH = "llama-gqa"


def _engine(path) -> MeteredEngine:
    return MeteredEngine(engine_config(path, block_size=BS, num_blocks=64))


def test_prompt_and_cached_tokens_are_counted_as_the_outputs_report_them(model_dir):
    engine = _engine(model_dir(ARCH))
    shared = prompt(14, seed=1)
    a = Request("a", shared + prompt(3, seed=2), greedy(5))
    b = Request("b", shared + prompt(5, seed=3), greedy(5))
    outs = [run_to_completion(engine, [a])["a"], run_to_completion(engine, [b])["b"]]
    totals = engine.totals()
    assert totals.prompt_tokens == sum(o.num_prompt_tokens for o in outs) == 17 + 19
    assert totals.cached_prompt_tokens == sum(o.num_cached_tokens for o in outs) == 12
    assert totals.generated_tokens == sum(len(o.token_ids) for o in outs) == 10
    assert engine.stats().kv_blocks_used == 0


def test_a_disaggregated_prompt_counts_on_the_prefill_engine_only(model_dir):
    path = model_dir(ARCH)
    prefill_engine, decode_engine = _engine(path), _engine(path)
    ids = prompt(11, seed=4)
    tokens = disaggregated(prefill_engine, decode_engine, "r", ids, greedy(6))
    p, d = prefill_engine.totals(), decode_engine.totals()
    assert (p.prompt_tokens, d.prompt_tokens) == (11, 0)
    assert p.generated_tokens + d.generated_tokens == len(tokens) == 6
    assert prefill_engine.stats().kv_blocks_used == decode_engine.stats().kv_blocks_used == 0
