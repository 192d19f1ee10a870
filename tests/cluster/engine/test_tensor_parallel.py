"""Tensor parallelism end to end on the CPU: a `TPReplica` (rank 0's engine in this process, the
other ranks in processes of their own, gloo on 127.0.0.1) must produce transformers' greedy
tokens on every architecture, through batching, chunked prefill and prefix-cache hits, with its
KV blocks all free afterwards; a dead follower fails the leader's step instead of hanging it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from cluster.engine.kv_cache import KVLayout
from cluster.engine.tp_replica import TPReplica
from cluster.errors import FailedPrecondition, InvalidArgument
from cluster.request import Request
from tests.conftest import TINY_SHAPE, build_checkpoint, engine_config, greedy, prompt

NEW_TOKENS = 12
# Llama with one KV head (MQA): fewer KV heads than ranks, so each rank holds a replica of it.
MQA = "llama-mqa"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            out = tmp_path_factory.mktemp(arch)
            if arch == MQA:
                cache[arch] = build_checkpoint("llama-gqa", out, num_key_value_heads=1)
            else:
                cache[arch] = build_checkpoint(arch, out)
        return cache[arch]

    return get


def _waves(engine, path, hf) -> None:
    """Three prompts at once (chunked: 8 tokens a step, 4-token blocks), then two that share
    the 40-token prompt's first 32 tokens (prefix-cache hits); all must equal transformers."""
    first = [Request(f"r{n}", prompt(n, seed=n), greedy(NEW_TOKENS)) for n in (3, 17, 40)]
    outs = engine.generate(first)
    shared = prompt(40, seed=40)[:32]
    second = [
        Request(f"hit{i}", shared + prompt(5 + i, seed=100 + i), greedy(NEW_TOKENS))
        for i in range(2)
    ]
    hits = engine.generate(second)
    assert [o.num_cached_tokens for o in hits] == [32, 32]
    for r, out in zip(first + second, outs + hits, strict=True):
        assert out.finish_reason == "length", out.error
        hf.assert_greedy(path, r.prompt_token_ids, out.token_ids, NEW_TOKENS)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0, "KV blocks leaked"
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


@pytest.mark.parametrize("arch", ["llama-gqa", MQA, "llama-tied", "mistral", "qwen2", "qwen3"])
def test_tp2_greedy_equals_transformers(arch, checkpoint, hf):
    path = checkpoint(arch)
    config = engine_config(path, block_size=4, max_num_batched_tokens=8)
    with TPReplica(config, 2) as replica:
        engine = replica.engine
        local = engine.layout.num_kv_heads
        assert local == (1 if arch == MQA else TINY_SHAPE["num_key_value_heads"] // 2)
        assert engine.kv_cache.k.shape[3] == local  # the pool holds this rank's heads only
        _waves(engine, path, hf)


@pytest.mark.slow
def test_tp4_replicates_kv_heads(checkpoint, hf):
    """4 ranks over 2 KV heads: each KV head lives on two ranks."""
    path = checkpoint("qwen3")
    config = engine_config(path, block_size=4, max_num_batched_tokens=8)
    with TPReplica(config, 4) as replica:
        assert replica.engine.layout.num_kv_heads == 1
        _waves(replica.engine, path, hf)


def test_sizes_that_do_not_split_are_refused(checkpoint):
    """3 ranks divide neither the 4 heads nor the 2 KV heads: refused before any step."""
    with pytest.raises(InvalidArgument, match="tensor_parallel_size 3"):
        TPReplica(engine_config(checkpoint("llama-gqa")), 3, start_timeout_s=120)


def test_dead_follower_fails_the_step(checkpoint):
    config = engine_config(checkpoint("llama-gqa"), block_size=4)
    replica = TPReplica(config, 2, timeout_s=10)
    try:
        engine = replica.engine
        engine.generate([Request("ok", prompt(5, seed=1), greedy(2))])
        os.kill(replica.followers[0].pid, signal.SIGKILL)
        replica.followers[0].join(10)
        engine.add_request(Request("after", prompt(5, seed=2), greedy(2)))
        start = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 (gloo's own error types)
            engine.step()
        assert time.monotonic() - start < 30
    finally:
        replica.close()
    assert not any(p.is_alive() for p in replica.followers)


def test_tp_pool_layout_differs_from_tp1(checkpoint):
    """A TP 2 rank's pool holds half the KV heads, and its layout says which: it does not match
    a TP 1 pool's (a whole-pool transfer between them fails FAILED_PRECONDITION; the head plan
    of cluster/kv_transfer/grpc/tp_ranks.py moves them instead), and a TP engine refuses an
    import unless its caller moves every rank's heads (`imports_every_rank`)."""
    path = checkpoint("llama-gqa")
    with TPReplica(engine_config(path), 2) as replica:
        ours = replica.engine.layout
        with pytest.raises(FailedPrecondition, match="tensor-parallel"):
            replica.engine.reserve_import(Request("in", prompt(5, seed=3), greedy(2)))
        assert replica.engine.stats().kv_blocks_used == 0
    assert (ours.kv_head_start, ours.total_kv_heads, ours.tp_size) == (0, 2, 2)
    whole = KVLayout(**{**ours.to_dict(), "num_kv_heads": 2, "tp_size": 1})
    with pytest.raises(FailedPrecondition):
        whole.check_matches(ours)
    # A TP 1 pool serves rank 0's heads as a head slice of its own (a slice names its server's
    # TP size), but not a layout of another TP size as if it were its own.
    assert whole.check_serves(KVLayout(**{**ours.to_dict(), "tp_size": 1})) == 0
    with pytest.raises(FailedPrecondition):
        whole.check_serves(ours)


def test_tp1_engine_has_no_tp_machinery(model_dir, make_engine):
    """TP 1 builds the plain runner over the SINGLE group: no step message, no collective."""
    from cluster.engine.model_runner import ModelRunner
    from cluster.model.parallel import SINGLE

    engine = make_engine(model_dir("llama-gqa"))
    assert type(engine.runner) is ModelRunner and engine.runner.model.tp is SINGLE
    assert engine.layout.num_kv_heads == TINY_SHAPE["num_key_value_heads"]
