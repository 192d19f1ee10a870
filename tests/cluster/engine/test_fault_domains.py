"""One request's fault is its own (issue 37, point 2): a request whose logits are not finite
(a temperature or repetition penalty that overflows float32, or a model row gone NaN), or
whose stop check or text raises, fails alone with a clear error and leaves no block; a greedy
request in the same batch gets exactly transformers' tokens. A fault of the engine itself
(the forward pass raises) fails every stream with Unavailable, so the router resumes them
elsewhere, and makes the engine report unhealthy.

The poisoned settings are set past `SamplingParams`' validation: the router may refuse or
clamp them, and what these tests check is the engine's own guard."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.errors import InvalidArgument, PdServeError, Unavailable
from cluster.request import Request, RequestOutput
from cluster.sampling_params import SamplingParams
from cluster.serving.replica import EngineReplica
from tests.cluster.engine.test_async_engine import _Collector
from tests.conftest import drive, greedy, prompt, step_into

VICTIM_TOKENS = 12


def unchecked(max_tokens: int = 8, **fields) -> SamplingParams:
    """Sampling settings with `fields` set as given, whatever validation would say (a greedy
    request stays greedy only at temperature 0)."""
    params = SamplingParams(max_tokens=max_tokens, seed=7, ignore_eos=True)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    params.__dict__["greedy"] = params.temperature == 0.0  # cached: as set, never floored
    return params


def _victim() -> Request:
    return Request("victim", prompt(16, seed=1), greedy(VICTIM_TOKENS))


def _beside_victim(engine: Engine, *others: Request) -> dict[str, RequestOutput]:
    """The victim decodes a few steps, then `others` join its batch; run all to the end."""
    engine.add_request(_victim())
    results: dict[str, RequestOutput] = {}
    for _ in range(3):
        step_into(engine, results)
    for r in others:
        engine.add_request(r)
    return drive(engine, results)


POISONS = {
    "temperature 1e-40": (dict(temperature=1e-40), "temperature"),
    "temperature 1e-45": (dict(temperature=1e-45), "temperature"),
    "repetition_penalty 1e-40, sampled": (dict(repetition_penalty=1e-40), "repetition_penalty"),
    "repetition_penalty 1e-40, greedy": (
        dict(temperature=0.0, repetition_penalty=1e-40),
        "repetition_penalty",
    ),
}


@pytest.mark.parametrize("poison", POISONS.values(), ids=POISONS.keys())
def test_a_request_whose_settings_overflow_its_logits_fails_alone(
    model_dir, make_engine, hf, poison
):
    fields, param = poison
    path = model_dir("llama-gqa")
    engine = make_engine(path)
    attacker = Request("attacker", prompt(20, seed=2), unchecked(**fields))
    results = _beside_victim(engine, attacker, Request("peer", prompt(9, seed=3), greedy(6)))
    failed = results["attacker"]
    assert (failed.finish_reason, failed.token_ids) == ("abort", [])
    assert isinstance(failed.error, InvalidArgument) and failed.error.param == param
    assert param in failed.error.message
    hf.assert_greedy(path, _victim().prompt_token_ids, results["victim"].token_ids, VICTIM_TOKENS)
    hf.assert_greedy(path, prompt(9, seed=3), results["peer"].token_ids, 6)
    assert engine.stats().kv_blocks_used == 0 and not engine.seqs


def test_a_row_the_model_made_nan_fails_alone_mid_stream(model_dir, make_engine, hf):
    """Raw logits that are not finite are no fault of the request's settings: INTERNAL, and
    the tokens it already had stay its own."""
    path = model_dir("llama-gqa")
    engine = make_engine(path)
    sample = engine.runner._sample

    def nan_row(logits, samplers):
        logits = logits.clone()
        for row, s in enumerate(samplers):
            if s.seq.request_id == "sick" and s.seq.num_output_tokens == 4:
                logits[row, 5] = torch.nan
        return sample(logits, samplers)

    engine.runner._sample = nan_row
    results = _beside_victim(engine, Request("sick", prompt(20, seed=2), greedy(10)))
    sick = results["sick"]
    assert (sick.finish_reason, len(sick.token_ids)) == ("abort", 4)
    assert type(sick.error) is PdServeError and "not finite" in sick.error.message
    hf.assert_greedy(path, _victim().prompt_token_ids, results["victim"].token_ids, VICTIM_TOKENS)


def test_an_exception_in_one_requests_sampling_fails_it_alone(model_dir, make_engine, hf):
    """The batched pass raises: it is redone row by row, and only the row that raises fails."""
    path = model_dir("llama-gqa")
    engine = make_engine(path)
    attacker = Request("attacker", prompt(20, seed=2), greedy(6))
    engine.runner.sampler = _RaisingFor(attacker.params, engine.runner.sampler)
    results = _beside_victim(engine, attacker)
    assert results["attacker"].finish_reason == "abort"
    assert "sampler broke" in results["attacker"].error.message
    hf.assert_greedy(path, _victim().prompt_token_ids, results["victim"].token_ids, VICTIM_TOKENS)


class _RaisingFor:
    """A sampler that raises whenever a batch holds a row with these very `params`."""

    def __init__(self, params: SamplingParams, sampler) -> None:
        self.params, self.sampler = params, sampler
        self.logprobs = sampler.logprobs

    def __call__(self, logits, params, *rows):
        if any(p is self.params for p in params):
            raise RuntimeError("sampler broke")
        return self.sampler(logits, params, *rows)


@pytest.mark.parametrize("where", ["stop check", "text"])
def test_an_exception_in_one_requests_stop_check_or_text_fails_it_alone(
    tokenizer_model_dir, make_engine, where
):
    """Inline (the engine detokenizes in its step), as `Engine.generate` runs."""
    engine = make_engine(tokenizer_model_dir)
    vocab = engine.info.spec.vocab_size
    victim = Request("victim", prompt(16, seed=1, vocab=vocab), greedy(VICTIM_TOKENS))
    alone = drive_one(engine, victim)
    engine.add_request(Request("attacker", prompt(20, seed=2, vocab=vocab), greedy(10)))
    _break(engine, "attacker", where)
    engine.add_request(victim)
    results = drive(engine)
    failed = results["attacker"]
    assert failed.finish_reason == "abort" and len(failed.token_ids) == 3
    assert type(failed.error) is PdServeError and "broke" in failed.error.message
    assert (results["victim"].token_ids, results["victim"].text) == (alone.token_ids, alone.text)
    assert not engine.seqs and engine.stats().kv_blocks_used == 0


def drive_one(engine: Engine, request: Request) -> RequestOutput:
    engine.add_request(request)
    return drive(engine)[request.request_id]


def _break(engine: Engine, rid: str, where: str) -> None:
    """Make `rid`'s fourth output raise: in its stop check (engine) or its text (processor)."""
    if where == "stop check":
        seq = engine.seqs[rid]
        append = seq.append_token

        def append_token(token_id: int, max_model_len: int):
            if seq.num_output_tokens == 3:
                raise RuntimeError("stop check broke")
            return append(token_id, max_model_len)

        seq.append_token = append_token
        return
    processor = engine.output_processor
    text = processor._text

    def broken_text(detok, out):
        if out.request_id == rid and out.num_output_tokens == 4:
            raise RuntimeError("detokenizer broke")
        return text(detok, out)

    processor._text = broken_text


@pytest.mark.parametrize("output_thread", [True, False])
def test_streams_and_sinks_of_failed_requests_fail_alone(
    tokenizer_model_dir, make_engine, output_thread
):
    """Through `AsyncEngine`: the attackers' streams (`generate`, a prefill-only prompt too)
    and sinks (`stream_to`) fail with their own error, the victim's stream and sink end with
    every token, and the engine stays healthy."""
    engine = make_engine(tokenizer_model_dir)
    vocab = engine.info.spec.vocab_size
    victim = Request("victim", prompt(16, seed=1, vocab=vocab), greedy(VICTIM_TOKENS))
    alone = drive_one(engine, victim)
    hot = unchecked(temperature=1e-40)
    attackers = [
        Request("stream", prompt(20, seed=2, vocab=vocab), hot),
        Request("prefill", prompt(20, seed=3, vocab=vocab), hot, prefill_only=True),
        Request("sink", prompt(20, seed=4, vocab=vocab), hot),
        Request("text", prompt(20, seed=5, vocab=vocab), greedy(10)),
    ]
    _break(engine, "text", "text")
    async_engine = AsyncEngine(engine, output_thread)

    async def streamed(request: Request) -> RequestOutput:
        result = RequestOutput(request.request_id)
        async for out in await async_engine.generate(request):
            result.add(out)
        return result

    async def sunk(request: Request) -> RequestOutput:
        sink = _Collector()
        await async_engine.stream_to(request.request_id, lambda e: e.add_request(request), sink)
        return sink.output

    async def main() -> list:
        async_engine.start()
        try:
            calls = [streamed(victim), sunk(replace_id(victim, "victim-sink"))]
            calls += [sunk(r) if r.request_id == "sink" else streamed(r) for r in attackers]
            got = await asyncio.gather(*calls, return_exceptions=True)
            assert async_engine.alive()
            assert await async_engine.call(lambda e: (len(e.seqs), e.stats().kv_blocks_used)) == (
                0,
                0,
            )
            return got
        finally:
            await async_engine.stop()

    victim_out, victim_sink, stream, prefill, sink, text = asyncio.run(main())
    for out in (victim_out, victim_sink):
        assert (out.token_ids, out.text, out.finish_reason) == (
            alone.token_ids,
            alone.text,
            alone.finish_reason,
        )
    for error in (stream, prefill, sink):
        assert isinstance(error, InvalidArgument) and error.param == "temperature", error
    assert type(text) is PdServeError and "detokenizer broke" in text.message


def replace_id(request: Request, rid: str) -> Request:
    return Request(rid, request.prompt_token_ids, request.params)


def test_a_failed_forward_pass_fails_every_stream_over_and_reports_unhealthy(
    model_dir, make_engine
):
    """The router resumes streams that fail with Unavailable on another replica; Serve's
    health check (`EngineReplica.check_health`) replaces a replica whose engine failed."""
    engine = make_engine(model_dir("llama-gqa"))
    model = engine.runner.model
    forward = model.forward
    calls = {"n": 0}

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("device lost")
        return forward(*args, **kwargs)

    model.forward = failing_forward
    async_engine = AsyncEngine(engine, output_thread=True)
    replica = types.SimpleNamespace(engine=async_engine)

    async def stream(request: Request) -> RequestOutput:
        result = RequestOutput(request.request_id)
        async for out in await async_engine.generate(request):
            result.add(out)
        return result

    async def main() -> None:
        async_engine.start()
        try:
            await EngineReplica.check_health(replica)
            requests = [Request(f"r{i}", prompt(16, seed=i), greedy(30)) for i in range(3)]
            got = await asyncio.gather(*map(stream, requests), return_exceptions=True)
            assert all(isinstance(e, Unavailable) for e in got), got
            assert "device lost" in str(got[0])
            assert not async_engine.alive()
            with pytest.raises(RuntimeError, match="device lost"):
                await EngineReplica.check_health(replica)
            with pytest.raises(Unavailable):
                await stream(Request("late", prompt(8, seed=9), greedy(4)))
            state = await async_engine.call(lambda e: (len(e.seqs), e.stats().kv_blocks_used))
            assert state == (0, 0)
        finally:
            await async_engine.stop()

    asyncio.run(main())
    assert calls["n"] == 6  # nothing stepped after the fault
