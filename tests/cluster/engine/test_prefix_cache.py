"""Prefix caching in the engine: what is reused and reported, what it yields to, and that the
tokens stay transformers' greedy tokens."""

from __future__ import annotations

import pytest

from cluster.request import Request
from tests.conftest import (
    ARCHS,
    disaggregated,
    drive,
    greedy,
    prefill,
    prompt,
    record_plans,
    run_to_completion,
)
from tests.engine_kv import export_kv

BS = 4
ARCH = "llama-gqa"


def prefill_starts(plans, rid: str) -> list[int]:
    """Where each of `rid`'s prompt chunks started."""
    return [start for p in plans for r, start, n in p.scheduled if r == rid and n > 1]


def test_a_shared_prefix_is_computed_once(model_dir, make_engine, hf):
    path = model_dir(ARCH)
    engine = make_engine(path, block_size=BS, num_blocks=64)
    plans = record_plans(engine)
    shared = prompt(14, seed=1)
    a = Request("a", shared + prompt(3, seed=2), greedy(6))
    b = Request("b", shared + prompt(5, seed=3), greedy(6))
    out_a = run_to_completion(engine, [a])["a"]
    out_b = run_to_completion(engine, [b])["b"]
    # The 14 shared tokens fill 3 blocks of 4; b computes from token 12 on.
    assert (out_a.num_cached_tokens, out_b.num_cached_tokens) == (0, 12)
    assert prefill_starts(plans, "a") == [0] and prefill_starts(plans, "b") == [12]
    # a computed 17 + 5 tokens (5 full blocks), b 19 + 5 (6 full blocks, 3 of them a's).
    stats = engine.stats()
    assert (stats.kv_blocks_cached, stats.kv_blocks_used) == (8, 0)
    hf.assert_greedy(path, a.prompt_token_ids, out_a.token_ids, 6)
    hf.assert_greedy(path, b.prompt_token_ids, out_b.token_ids, 6)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cached_prefixes_match_transformers_on_every_architecture(arch, model_dir, make_engine, hf):
    """Prompts sharing a 25-token prefix (longer than Mistral's 16-token window), run in turn
    and then together with chunked prefill: each continues from the cached blocks and still
    decodes transformers' greedy tokens."""
    path = model_dir(arch)
    engine = make_engine(path, block_size=BS, num_blocks=96, max_num_batched_tokens=8)
    shared = prompt(25, seed=50)
    first = Request("first", shared + prompt(2, seed=51), greedy(8))
    later = [Request(f"r{i}", shared + prompt(3 + i, seed=52 + i), greedy(8)) for i in range(3)]
    outs = run_to_completion(engine, [first])
    outs |= run_to_completion(engine, later)
    assert [outs[r.request_id].num_cached_tokens for r in later] == [24, 24, 24]
    for r in [first, *later]:
        hf.assert_greedy(path, r.prompt_token_ids, outs[r.request_id].token_ids, 8)


def test_a_repeated_prompt_still_computes_its_last_token(model_dir, make_engine):
    engine = make_engine(model_dir(ARCH), block_size=BS, num_blocks=64)
    plans = record_plans(engine)
    ids = prompt(16, seed=4)  # exactly 4 full blocks
    first = run_to_completion(engine, [Request("a", ids, greedy(5))])["a"]
    again = run_to_completion(engine, [Request("b", ids, greedy(5))])["b"]
    assert again.num_cached_tokens == 12  # the 4th block holds the token that yields logits
    assert [s for p in plans for r, s, n in p.scheduled if r == "b"][0] == 12
    assert again.token_ids == first.token_ids


def test_generated_tokens_are_cached_too(model_dir, make_engine):
    """A follow-up prompt that repeats an earlier prompt and its answer (a chat's next turn)
    finds the answer's blocks cached as well."""
    engine = make_engine(model_dir(ARCH), block_size=BS, num_blocks=64)
    ids = prompt(10, seed=5)
    first = run_to_completion(engine, [Request("a", ids, greedy(11))])["a"]
    turn = ids + tuple(first.token_ids) + prompt(3, seed=6)  # 24 tokens
    out = run_to_completion(engine, [Request("b", turn, greedy(3))])["b"]
    # The first request computed the KV of 10 + 10 tokens (its last sampled token never went
    # through the model): 5 full blocks.
    assert out.num_cached_tokens == 20


def test_cached_blocks_yield_to_new_work(model_dir, make_engine, hf):
    """A pool too small to keep every prompt: cached blocks are reclaimed as needed, outputs
    stay right, and nothing stays in use (make_engine checks)."""
    path = model_dir(ARCH)
    engine = make_engine(path, block_size=BS, num_blocks=8)
    for i in range(5):
        r = Request(f"r{i}", prompt(17, seed=10 + i), greedy(6))
        out = run_to_completion(engine, [r])[r.request_id]
        assert out.num_cached_tokens == 0
        hf.assert_greedy(path, r.prompt_token_ids, out.token_ids, 6)
        assert engine.scheduler.blocks.num_used == 0 and engine.scheduler.blocks.num_cached <= 8
    # The most recent prompt's prefix survived; it is found again.
    again = run_to_completion(engine, [Request("x", prompt(17, seed=14), greedy(2))])["x"]
    assert again.num_cached_tokens == 16


def test_preemption_with_caching_keeps_outputs_right(model_dir, make_engine, hf):
    path = model_dir(ARCH)
    engine = make_engine(path, block_size=BS, num_blocks=16)
    plans = record_plans(engine)
    requests = [Request(f"p{i}", prompt(9 + 5 * i, seed=20 + i), greedy(20)) for i in range(3)]
    outs = run_to_completion(engine, requests)
    assert any(p.preempted for p in plans), "nothing was preempted"
    for r in requests:
        hf.assert_greedy(path, r.prompt_token_ids, outs[r.request_id].token_ids, 20)


def test_held_prompt_blocks_are_shared_with_a_later_prompt(model_dir, make_engine):
    """Prefill role: a prompt whose KV is held for export lends its blocks to the next prompt
    with the same prefix; both exports are whole, and releasing both frees everything."""
    engine = make_engine(model_dir(ARCH), block_size=BS, num_blocks=64)
    shared = prompt(12, seed=7)
    prefill(engine, Request("a", shared + prompt(2, seed=8), greedy(4), prefill_only=True))
    prefill(engine, Request("b", shared + prompt(3, seed=9), greedy(4), prefill_only=True))
    blocks_a, _ = engine.held_blocks("a")
    blocks_b, n_b = engine.held_blocks("b")
    assert blocks_a[:3] == blocks_b[:3] and engine.scheduler.blocks.ref_count(blocks_a[0]) == 2
    assert export_kv(engine, "b").num_tokens == n_b == 15
    assert engine.release("a") and engine.release("b")
    assert engine.scheduler.blocks.num_used == 0


def test_disaggregated_output_is_the_same_with_a_cached_prefix(model_dir, make_engine):
    path = model_dir(ARCH)
    pre = make_engine(path, block_size=BS, num_blocks=64)
    dec = make_engine(path, block_size=BS, num_blocks=64)
    plain = make_engine(path, block_size=BS, num_blocks=64, enable_prefix_caching=False)
    plans = record_plans(pre)
    shared = prompt(13, seed=11)
    for rid, tail in (("a", 4), ("b", 6)):
        ids = shared + prompt(tail, seed=len(rid) + tail)
        got = disaggregated(pre, dec, rid, ids, greedy(8))
        want = run_to_completion(plain, [Request(rid, ids, greedy(8))])[rid].token_ids
        assert got == want
    assert prefill_starts(plans, "b") == [12]


def test_caching_off_recomputes_everything(model_dir, make_engine):
    engine = make_engine(model_dir(ARCH), block_size=BS, num_blocks=64, enable_prefix_caching=False)
    plans = record_plans(engine)
    ids = prompt(16, seed=12)
    for rid in ("a", "b"):
        engine.add_request(Request(rid, ids, greedy(3)))
        assert drive(engine)[rid].num_cached_tokens == 0
    assert prefill_starts(plans, "b") == [0] and engine.stats().kv_blocks_cached == 0


def test_queued_prompt_tokens_leave_out_the_prefix_the_cache_holds(model_dir, make_engine):
    """The prefill pool's autoscaling signal counts what admission would still compute: a
    queued prompt whose prefix is cached counts only the rest."""
    engine = make_engine(model_dir(ARCH), block_size=BS, num_blocks=64)
    shared = prompt(14, seed=20)
    run_to_completion(engine, [Request("a", shared + prompt(3, seed=21), greedy(2))])
    engine.add_request(Request("b", shared + prompt(5, seed=22), greedy(2)))  # 19 tokens
    engine.add_request(Request("c", prompt(9, seed=23), greedy(2)))  # nothing cached
    # b: 3 blocks of 4 of the shared prefix are cached, 19 - 12 = 7 left; c: all 9.
    assert engine.stats().queued_prompt_tokens == 7 + 9
    assert engine.scheduler.waiting[0].block_table == []  # counting took no blocks
    drive(engine)
    assert engine.stats().queued_prompt_tokens == 0


def test_queued_prompt_tokens_count_everything_with_caching_off(model_dir, make_engine):
    engine = make_engine(model_dir(ARCH), block_size=BS, num_blocks=64, enable_prefix_caching=False)
    shared = prompt(14, seed=20)
    run_to_completion(engine, [Request("a", shared + prompt(3, seed=21), greedy(2))])
    engine.add_request(Request("b", shared + prompt(5, seed=22), greedy(2)))
    assert engine.stats().queued_prompt_tokens == 19
    drive(engine)
