"""A generation resumed elsewhere (decode migration) goes on exactly as if it never moved.

`Request.output_token_ids` carries the tokens the client already has: the resumed engine
computes their KV with the prompt's and continues. Greedy and seeded tokens, text held back for
a stop string, and a stop string that spans the resume point all equal an unmoved run, resumed
colocated or through prefill -> export -> import -> decode, at several resume points.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.errors import InvalidArgument
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.conftest import drive, greedy, prompt, run_to_completion
from tests.engine_kv import export_kv, import_kv

NEW = 16
SAMPLED = SamplingParams(max_tokens=NEW, temperature=1.0, top_p=0.9, seed=1234)


def _unmoved(engine, ids, params):
    return run_to_completion(engine, [Request("whole", ids, params)])["whole"]


def _resumed_colocated(engine, rid, ids, params, done: list[int]):
    return run_to_completion(engine, [Request(rid, ids, params, output_token_ids=tuple(done))])[rid]


@pytest.mark.parametrize("params", [greedy(NEW), SAMPLED], ids=["greedy", "seeded"])
def test_resumed_tokens_equal_an_unmoved_run(params, model_dir, make_engine, hf):
    path = model_dir("llama-gqa")
    ids = prompt(21, seed=3)
    whole = _unmoved(make_engine(path, block_size=4), ids, params).token_ids
    assert len(whole) == NEW
    if params.greedy:
        hf.assert_greedy(path, ids, whole, NEW)
    colocated = make_engine(path, block_size=4)
    pre, dec = make_engine(path, block_size=4), make_engine(path, block_size=4, num_blocks=64)
    for k in (1, 2, 7, NEW - 1):  # right after the prefill's token, mid-block, the last one
        out = _resumed_colocated(colocated, f"c{k}", ids, params, whole[:k])
        assert out.token_ids == whole[k:] and out.finish_reason == "length", k
        rid = f"d{k}"
        request = Request(rid, ids, params, prefill_only=True, output_token_ids=tuple(whole[:k]))
        pre.add_request(request)
        first = drive(pre)[rid]
        assert first.finish_reason == ("prefilled" if k < NEW - 1 else "length")
        if first.finish_reason == "prefilled":
            kv = export_kv(pre, rid)
            assert kv.num_tokens == len(ids) + k
            import_kv(dec, replace(request, prefill_only=False), kv, first.token_ids[0])
            rest = drive(dec)[rid].token_ids
            assert pre.release(rid)
        else:
            rest = []
        assert [*first.token_ids, *rest] == whole[k:], k
    for e in (colocated, pre, dec):  # cached prefixes stay registered, but free to reuse
        assert e.config.cache.enable_prefix_caching and e.stats().kv_blocks_cached > 0
        assert e.stats().kv_blocks_used == 0 and not e.seqs


def test_resumed_text_and_a_stop_string_across_the_resume_point(
    tokenizer_model_dir, make_engine, hf
):
    """The client's text so far plus the resumed stream's text equals the unmoved text, and a
    stop string whose first half came before the move still stops (and is cut)."""
    path = tokenizer_model_dir
    engine = make_engine(path, block_size=4)
    ids = prompt(12, seed=5, vocab=engine.info.spec.vocab_size)
    free = _unmoved(engine, ids, greedy(NEW))
    i, stop = _first_new_pair(engine.tokenizer, free.token_ids)
    params = greedy(NEW, stop=(stop,))
    whole = _unmoved(engine, ids, params)
    assert whole.finish_reason == "stop" and len(whole.token_ids) == i + 1
    for k in (i - 1, i):  # the move before the stop string starts; between its two halves
        rid = f"r{k}"
        before = _text_streamed(engine, ids, params, k)
        after = _resumed_colocated(engine, rid, ids, params, whole.token_ids[:k])
        assert before + after.text == whole.text, k
        assert [*whole.token_ids[:k], *after.token_ids] == whole.token_ids, k
        assert after.finish_reason == "stop"


def _first_new_pair(tokenizer, tokens: list[int]) -> tuple[int, str]:
    """The first output `i` whose text, with the text of output `i - 1` before it, appears in
    the output text only there: (i, that text) — a stop string that outputs i - 1 and i make."""
    for i in range(2, len(tokens)):
        pair = tokenizer.decode(tokens[i - 1 : i + 1])
        upto = tokenizer.decode(tokens[: i + 1])
        if pair.strip() and upto.find(pair) == len(upto) - len(pair):
            return i, pair
    raise AssertionError(f"no fresh token pair in {tokens}")


def _text_streamed(engine, ids, params, k: int) -> str:
    """The text a client had after the first `k` tokens of an unmoved run."""
    engine.add_request(Request("head", ids, replace(params)))
    text, n = "", 0
    while n < k:
        for out in engine.step():
            if out.request_id == "head":
                text += out.text
                n += len(out.token_ids)
    engine.abort("head")
    engine.step()
    return text


def test_a_resume_with_no_room_left_or_foreign_tokens_is_refused(model_dir, make_engine):
    engine = make_engine(model_dir("llama-gqa"), block_size=4)
    ids = prompt(10, seed=1)
    for done in ([1] * 4, [10**9]):
        with pytest.raises(InvalidArgument):
            engine.add_request(Request("x", ids, greedy(4), output_token_ids=tuple(done)))
    assert engine.stats().kv_blocks_used == 0
