"""Prefill on one engine, export the prompt KV, import it into another and decode there: the
tokens equal an uninterrupted colocated run and the transformers oracle."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.errors import FailedPrecondition, NotFound
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.conftest import ARCHS, drive, greedy, prefill, prompt, run_to_completion
from tests.engine_kv import export_kv, import_kv

NEW_TOKENS = 12


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("length", [5, 17, 40])  # one block, inside a block, past the window
def test_export_import_matches_colocated_and_oracle(arch, length, model_dir, make_engine, hf):
    path = model_dir(arch)
    a = make_engine(path, block_size=4, max_num_batched_tokens=16)
    b = make_engine(path, block_size=4, num_blocks=64)
    colocated = make_engine(path, block_size=4)
    ids, params = prompt(length, seed=length), greedy(NEW_TOKENS)

    # Something already decoding on B, so the imported blocks land on other block ids.
    b.add_request(Request("other", prompt(9, seed=99), greedy(NEW_TOKENS)))
    b.step()

    first = prefill(a, Request("r", ids, params, prefill_only=True))
    stats = a.stats()
    assert (stats.held, stats.kv_blocks_leased) == (1, -(-length // 4))
    assert stats.generated_tokens == 1  # chunked or not, the prompt samples one token
    kv = export_kv(a, "r")
    assert kv.num_tokens == length
    import_kv(b, Request("r", ids, params), kv, first)
    assert b.seqs["r"].block_table != a.held_blocks("r")[0]
    out = drive(b)
    assert out["r"].finish_reason == "length"
    assert out["other"].finish_reason == "length"
    tokens = [first, *out["r"].token_ids]
    # "other" sampled all its tokens here; "r" all but the prefill's
    assert b.stats().generated_tokens == 2 * NEW_TOKENS - 1

    want = run_to_completion(colocated, [Request("r", ids, params)])["r"].token_ids
    assert tokens == want
    hf.assert_greedy(path, ids, tokens, NEW_TOKENS)

    assert a.stats().kv_blocks_used > 0  # still held until released
    assert a.release("r")
    assert a.stats().held == 0


def test_release_is_idempotent_and_export_unknown_is_not_found(model_dir, make_engine):
    path = model_dir("llama-gqa")
    a = make_engine(path, block_size=4)
    with pytest.raises(NotFound):
        export_kv(a, "nope")
    assert a.release("nope") is False
    prefill(a, Request("r", prompt(10, seed=1), greedy(4), prefill_only=True))
    assert a.release("r") is True
    assert a.release("r") is False
    assert a.stats().kv_blocks_used == 0
    with pytest.raises(NotFound):
        export_kv(a, "r")  # released blocks are never read again


def test_export_of_running_request_is_not_found(model_dir, make_engine):
    path = model_dir("llama-gqa")
    a = make_engine(path, block_size=4)
    a.add_request(Request("r", prompt(10, seed=1), greedy(8)))  # not prefill_only
    a.step()
    with pytest.raises(NotFound):
        export_kv(a, "r")
    drive(a)


@pytest.fixture
def exported(model_dir, make_engine):
    """A held prefill on engine A: (A, request, first token, KVExport). Released after."""
    path = model_dir("llama-gqa")
    a = make_engine(path, block_size=4)
    request = Request("r", prompt(10, seed=1), greedy(6))
    first = prefill(a, dataclasses.replace(request, prefill_only=True))
    yield a, request, first, export_kv(a, "r")
    a.release("r")


def _assert_still_serves(engine, exported) -> None:
    """After a refused import, a good import of the same request still decodes correctly."""
    a, request, first, kv = exported
    import_kv(engine, request, kv, first)
    out = drive(engine)["r"]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == request.params.max_tokens - 1


def test_import_with_other_block_size_fails_precondition(model_dir, make_engine, exported):
    _, request, first, kv = exported
    b = make_engine(model_dir("llama-gqa"), block_size=8)
    with pytest.raises(FailedPrecondition, match="block_size"):
        import_kv(b, request, kv, first)
    assert b.stats().kv_blocks_used == 0 and "r" not in b.seqs


def test_import_from_other_model_fails_precondition(model_dir, make_engine, exported):
    _, request, first, kv = exported
    b = make_engine(model_dir("qwen3"), block_size=4)
    with pytest.raises(FailedPrecondition, match="model_id"):
        import_kv(b, request, kv, first)
    assert b.stats().kv_blocks_used == 0


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda kv: (kv.k[:, :-1], kv.v[:, :-1]), id="one-block-short"),
        pytest.param(lambda kv: (kv.k[..., :-1], kv.v[..., :-1]), id="head-dim-short"),
        pytest.param(lambda kv: (kv.k, kv.v[:, :, :-1]), id="v-block-size-short"),
    ],
)
def test_import_with_wrong_tensor_shape_fails_precondition(
    corrupt, model_dir, make_engine, exported
):
    _, request, first, kv = exported
    b = make_engine(model_dir("llama-gqa"), block_size=4)
    k, v = corrupt(kv)
    with pytest.raises(FailedPrecondition):
        import_kv(b, request, dataclasses.replace(kv, k=k, v=v), first)
    assert b.stats().kv_blocks_used == 0, "a refused import leaked blocks"
    assert "r" not in b.seqs
    _assert_still_serves(b, exported)


def test_import_with_wrong_token_count_fails_precondition(model_dir, make_engine, exported):
    _, request, first, kv = exported
    b = make_engine(model_dir("llama-gqa"), block_size=4)
    shorter = dataclasses.replace(request, prompt_token_ids=request.prompt_token_ids[:-1])
    with pytest.raises(FailedPrecondition):
        import_kv(b, shorter, kv, first)
    assert b.stats().kv_blocks_used == 0
    _assert_still_serves(b, exported)


def test_import_that_finishes_at_once_reports_it(model_dir, make_engine, exported):
    """With max_tokens == 1 the prefill side's token is the whole output: the import finishes
    the request at once, reports "length" on the next step and frees the blocks."""
    _, request, first, kv = exported
    b = make_engine(model_dir("llama-gqa"), block_size=4)
    one = dataclasses.replace(request, params=SamplingParams(max_tokens=1, temperature=0.0))
    import_kv(b, one, kv, first)
    assert b.stats().kv_blocks_used == 0
    out = drive(b)["r"]
    assert out.finish_reason == "length"
    assert out.token_ids == []  # the first token was already streamed by the prefill side


def test_many_exports_in_flight(model_dir, make_engine, hf):
    """Several held prefills, exported and decoded in another order than they were made."""
    path = model_dir("mistral")
    a = make_engine(path, block_size=4, max_num_batched_tokens=16)
    b = make_engine(path, block_size=4)
    requests = [Request(f"r{n}", prompt(n, seed=n), greedy(NEW_TOKENS)) for n in (5, 17, 40)]
    firsts = {}
    for r in requests:
        a.add_request(dataclasses.replace(r, prefill_only=True))
    for rid, out in drive(a).items():
        assert out.finish_reason == "prefilled"
        firsts[rid] = out.token_ids[0]
    assert a.stats().held == 3
    for r in reversed(requests):
        import_kv(b, r, export_kv(a, r.request_id), firsts[r.request_id])
        assert a.release(r.request_id)
    assert a.stats().kv_blocks_used == 0
    outputs = drive(b)
    for r in requests:
        tokens = [firsts[r.request_id], *outputs[r.request_id].token_ids]
        hf.assert_greedy(path, r.prompt_token_ids, tokens, NEW_TOKENS)


def test_a_reserved_import_is_never_scheduled_and_is_freed_unless_finished(model_dir, make_engine):
    """`reserve_import` holds blocks for a transport to write; until `finish_import` the
    sequence does not run (its stats count it as waiting), and `cancel_import` (or `abort`)
    frees them."""
    path = model_dir("llama-gqa")
    a, b = make_engine(path, block_size=4), make_engine(path, block_size=4)
    ids, params = prompt(10, seed=3), greedy(4)
    first = prefill(a, Request("r", ids, params, prefill_only=True))
    kv = export_kv(a, "r")
    for i, rid in enumerate(("cancelled", "aborted")):
        blocks = b.reserve_import(Request(rid, ids, params))
        assert len(blocks) == 3 and b.stats().kv_blocks_used == 3 * (i + 1)
        assert (b.stats().running, b.stats().waiting) == (0, i + 1)
        assert not b.has_work() and b.step() == []
    assert b.cancel_import("cancelled") and not b.cancel_import("cancelled")
    assert b.abort("aborted") and b.stats().kv_blocks_used == 0
    blocks = b.reserve_import(Request("r", ids, params))
    gathered = a.kv_cache.gather(a.held_blocks("r")[0])  # [2, layers, blocks, ...]
    assert gathered.shape == (2, *kv.k.shape)
    b.kv_cache.write(blocks, gathered[0], gathered[1])
    assert (b.stats().running, b.stats().waiting) == (0, 1)
    b.finish_import("r", first)
    assert (b.stats().running, b.stats().waiting) == (1, 0)
    assert not b.cancel_import("r")
    with pytest.raises(NotFound):
        b.finish_import("r", first)
    assert a.release("r")
    out = drive(b)
    assert out["r"].finish_reason == "length" and b.stats().kv_blocks_used == 0
    want = run_to_completion(make_engine(path), [Request("c", ids, params)])["c"]
    assert [first, *out["r"].token_ids] == list(want.token_ids)
