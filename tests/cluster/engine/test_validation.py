"""Bad input is refused with InvalidArgument naming the field, and the engine keeps serving; stop
conditions (stop tokens, max_tokens, EOS, context limit, abort) end requests as documented."""

from __future__ import annotations

import math

import pytest

from cluster.errors import InvalidArgument
from cluster.model.info import SUPPORTED_ARCHITECTURES
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.conftest import (
    TINY_SHAPE,
    drive,
    engine_config,
    greedy,
    prompt,
    run_to_completion,
    step_into,
    with_eos,
)

VOCAB = TINY_SHAPE["vocab_size"]
CONTEXT = TINY_SHAPE["max_position_embeddings"]
GOOD = Request("good", prompt(11, seed=3), greedy(8))


@pytest.fixture
def path(model_dir):
    return model_dir("llama-gqa")


def _assert_serves(engine, path, hf, results=None) -> None:
    """The engine (possibly mid-way through other work) still completes a good request, and
    its output equals the oracle."""
    results = {} if results is None else results
    engine.add_request(GOOD)
    drive(engine, results)
    hf.assert_greedy(path, GOOD.prompt_token_ids, results["good"].token_ids, 8)


@pytest.mark.parametrize(
    ("ids", "param", "words"),
    [
        pytest.param((), "prompt", "prompt", id="empty"),
        pytest.param(prompt(CONTEXT, seed=1), "prompt", "context", id="context-full"),
        pytest.param(prompt(CONTEXT + 50, seed=1), "prompt", "context", id="over-context"),
        pytest.param((1, 2, -1, 4), "prompt_token_ids", "prompt_token_ids", id="negative-id"),
        pytest.param((1, 2, VOCAB, 4), "prompt_token_ids", "vocabulary", id="id-equal-vocab"),
        pytest.param((10**9,), "prompt_token_ids", "vocabulary", id="huge-id"),
    ],
)
def test_bad_prompt_is_refused_and_engine_keeps_serving(ids, param, words, path, make_engine, hf):
    engine = make_engine(path, block_size=4)
    engine.add_request(Request("busy", prompt(9, seed=2), greedy(6)))
    results: dict = {}
    step_into(engine, results)
    with pytest.raises(InvalidArgument) as err:
        engine.add_request(Request("bad", ids, greedy(4)))
    assert err.value.param == param
    assert words in str(err.value)
    assert "bad" not in engine.seqs
    _assert_serves(engine, path, hf, results)
    assert results["busy"].finish_reason == "length"


def test_prompt_and_max_tokens_filling_the_context_run_to_the_limit(path, make_engine, hf):
    engine = make_engine(path)
    ids = prompt(CONTEXT - 3, seed=4)
    out = run_to_completion(engine, [Request("r", ids, greedy(3))])["r"]
    assert out.finish_reason == "length"
    hf.assert_greedy(path, ids, out.token_ids, 3)


def test_max_tokens_past_the_context_is_refused_and_engine_keeps_serving(path, make_engine, hf):
    """Refused on admission too (the router checks first), never silently cut short."""
    engine = make_engine(path, block_size=4)
    engine.add_request(Request("busy", prompt(9, seed=2), greedy(6)))
    results: dict = {}
    step_into(engine, results)
    for max_tokens in (4, 2**31 - 1):
        with pytest.raises(InvalidArgument) as err:
            engine.add_request(Request("bad", prompt(CONTEXT - 3, seed=4), greedy(max_tokens)))
        assert err.value.param == "max_tokens"
        assert str(CONTEXT) in str(err.value) and str(max_tokens) in str(err.value)
    assert "bad" not in engine.seqs
    _assert_serves(engine, path, hf, results)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"max_tokens": 0}, "max_tokens", id="max_tokens=0"),
        pytest.param({"max_tokens": -3}, "max_tokens", id="max_tokens<0"),
        pytest.param({"temperature": -0.1}, "temperature", id="temperature<0"),
        pytest.param({"temperature": math.nan}, "temperature", id="temperature-nan"),
        pytest.param({"temperature": math.inf}, "temperature", id="temperature-inf"),
        pytest.param({"top_p": 0.0}, "top_p", id="top_p=0"),
        pytest.param({"top_p": 1.5}, "top_p", id="top_p>1"),
        pytest.param({"top_p": math.nan}, "top_p", id="top_p-nan"),
        pytest.param({"top_k": -1}, "top_k", id="top_k<0"),
        pytest.param({"seed": -1}, "seed", id="seed<0"),
        pytest.param({"stop": ("",)}, "stop", id="empty-stop"),
        pytest.param({"stop_token_ids": (-1,)}, "stop_token_ids", id="negative-stop-token"),
        pytest.param({"stop": ("x",) * 65}, "stop", id="too-many-stops"),
        pytest.param({"stop": ("x" * 513,)}, "stop", id="stop-too-long"),
        pytest.param({"stop_token_ids": (1,) * 1025}, "stop_token_ids", id="too-many-stop-ids"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)
    assert err.value.param == field
    assert field in str(err.value)


def test_stop_bounds_are_inclusive():
    params = SamplingParams(stop=("x" * 512,) * 64, stop_token_ids=(1,) * 1024)
    assert len(params.stop) == 64 and len(params.stop_token_ids) == 1024


def test_duplicate_request_id_in_flight_is_refused(path, make_engine, hf):
    engine = make_engine(path, block_size=4)
    first = Request("dup", prompt(9, seed=2), greedy(6))
    engine.add_request(first)
    results: dict = {}
    step_into(engine, results)
    with pytest.raises(InvalidArgument) as err:
        engine.add_request(Request("dup", prompt(5, seed=9), greedy(3)))
    assert err.value.param == "request_id" and "dup" in str(err.value)
    _assert_serves(engine, path, hf, results)
    hf.assert_greedy(path, first.prompt_token_ids, results["dup"].token_ids, 6)
    # Once finished, the id is free again.
    again = run_to_completion(engine, [first])["dup"]
    assert again.token_ids == results["dup"].token_ids


def test_duplicate_of_held_request_is_refused(path, make_engine):
    engine = make_engine(path, block_size=4)
    held = Request("h", prompt(9, seed=2), greedy(6), prefill_only=True)
    engine.add_request(held)
    drive(engine)
    with pytest.raises(InvalidArgument):
        engine.add_request(held)
    assert engine.release("h")


def test_unsupported_architecture_is_refused(gpt2_dir, make_engine, path, hf):
    with pytest.raises(InvalidArgument) as err:
        make_engine(gpt2_dir)
    message = str(err.value)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)
    _assert_serves(make_engine(path), path, hf)


def test_not_a_checkpoint_is_refused(tmp_path, make_engine):
    with pytest.raises(InvalidArgument, match="config.json"):
        make_engine(tmp_path)


def test_bad_engine_config_is_refused(path):
    with pytest.raises(InvalidArgument, match="block_size"):
        engine_config(path, block_size=3)
    with pytest.raises(InvalidArgument, match="dtype"):
        engine_config(path, dtype="float8")


# -- stopping -----------------------------------------------------------------------------


def test_stop_token_ids_stop_with_stop(path, make_engine, hf_greedy):
    ids = prompt(11, seed=3)
    want = hf_greedy(path, ids, 16)
    k = next(i for i in range(2, 16) if want[i] not in want[:i])
    engine = make_engine(path, block_size=4)
    unused = next(t for t in range(VOCAB) if t not in want)
    params = greedy(16, stop_token_ids=(unused, want[k]))
    out = run_to_completion(engine, [Request("r", ids, params)])["r"]
    assert out.finish_reason == "stop"
    assert out.token_ids == want[: k + 1]


def test_max_tokens_stops_with_length(path, make_engine, hf):
    engine = make_engine(path, block_size=4)
    outs = run_to_completion(
        engine, [Request(f"r{n}", GOOD.prompt_token_ids, greedy(n)) for n in (1, 2, 7)]
    )
    for n in (1, 2, 7):
        assert outs[f"r{n}"].finish_reason == "length"
        hf.assert_greedy(path, GOOD.prompt_token_ids, outs[f"r{n}"].token_ids, n)


@pytest.fixture
def eos_case(path, hf, tmp_path):
    """A copy of the checkpoint whose EOS is the oracle's greedy token at step k, so greedy
    decoding of `ids` meets EOS there: (checkpoint, ids, k, oracle tokens)."""
    ids = prompt(11, seed=3)
    want = hf.greedy(path, ids, 16)
    k = next(i for i in range(2, 16) if want[i] not in want[:i])
    return with_eos(path, tmp_path / "eos", want[k]), ids, k, want


def test_eos_stops_with_stop(eos_case, make_engine):
    eos_path, ids, k, want = eos_case
    engine = make_engine(eos_path, block_size=4)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    out = run_to_completion(engine, [Request("r", ids, params)])["r"]
    assert out.finish_reason == "stop"
    assert out.token_ids == want[: k + 1]


def test_ignore_eos_runs_to_max_tokens(eos_case, make_engine):
    eos_path, ids, k, want = eos_case
    engine = make_engine(eos_path, block_size=4)
    out = run_to_completion(engine, [Request("r", ids, greedy(16))])["r"]
    assert out.finish_reason == "length"
    assert out.token_ids == want
    assert want[k] in out.token_ids


def test_eos_as_first_token_of_a_prefill(eos_case, make_engine):
    """Prefill-only meeting EOS first finishes with "stop" and holds nothing."""
    eos_path, ids, k, want = eos_case
    engine = make_engine(eos_path, block_size=4)
    prefix = ids + tuple(want[:k])
    params = SamplingParams(max_tokens=4, temperature=0.0)
    out = run_to_completion(engine, [Request("r", prefix, params, prefill_only=True)])["r"]
    assert (out.finish_reason, out.token_ids) == ("stop", [want[k]])
    assert engine.stats().held == 0


def test_abort_running_request_frees_blocks(path, make_engine, hf):
    engine = make_engine(path, block_size=4)
    engine.add_request(Request("a", prompt(20, seed=1), greedy(50)))
    engine.add_request(Request("w", prompt(20, seed=2), greedy(50)))
    results: dict = {}
    for _ in range(3):
        step_into(engine, results)
    used = engine.stats().kv_blocks_used
    assert engine.seqs["a"].block_table and used > 0
    assert engine.abort("a") is True
    assert engine.stats().kv_blocks_used == used - 6  # 20 prompt + 3 output tokens' blocks
    assert engine.abort("a") is False
    step_into(engine, results)
    assert results["a"].finish_reason == "abort"
    assert len(results["a"].token_ids) == 3
    assert engine.abort("w")
    _assert_serves(engine, path, hf, results)
    assert results["w"].finish_reason == "abort"


def test_abort_waiting_and_held_requests(path, make_engine):
    engine = make_engine(path, block_size=4)
    engine.add_request(Request("w", prompt(20, seed=1), greedy(5)))
    assert engine.abort("w")
    assert drive(engine)["w"].finish_reason == "abort"
    engine.add_request(Request("h", prompt(20, seed=1), greedy(5), prefill_only=True))
    drive(engine)
    assert engine.stats().kv_blocks_used == 5
    assert engine.abort("h")
    assert engine.stats().kv_blocks_used == 0
    assert not engine.release("h")
    assert engine.abort("unknown") is False


def test_request_larger_than_pool_does_not_hang(path, make_engine):
    """A request whose prompt fits the pool but whose output cannot must end (refused up front,
    or finished), never wait forever."""
    engine = make_engine(path, block_size=4, num_blocks=4)  # 16 slots
    try:
        engine.add_request(Request("big", prompt(10, seed=2), greedy(30)))
    except InvalidArgument as err:
        assert err.param in ("max_tokens", "prompt")
        return
    out = drive(engine, max_steps=200)["big"]
    assert out.finish_reason is not None
