"""Constrained requests on the engine, with a random-weight model: whatever it would write,
the output matches its constraint, on one engine, across the prefill/decode hop and after a
migration; an unconstrained request in the same batch is untouched (transformers' tokens)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.errors import InvalidArgument
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from cluster.structured_output import StructuredOutput
from tests.conftest import disaggregated, drive, greedy, prompt, run_to_completion

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
CONSTRAINED = StructuredOutput.schema(SCHEMA)


def sampled(seed: int, so: StructuredOutput = CONSTRAINED) -> SamplingParams:
    return SamplingParams(max_tokens=80, temperature=1.0, seed=seed, structured=so)


def valid(tokenizer, token_ids: list[int]) -> dict:
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_sampled_constrained_requests_return_schema_valid_json(make_engine, tokenizer_model_dir):
    engine = make_engine(tokenizer_model_dir)
    requests = [Request(f"r{i}", prompt(12, i, 4096), sampled(i)) for i in range(20)]
    results = run_to_completion(engine, requests)
    for i in range(20):
        out = results[f"r{i}"]
        assert out.finish_reason == "stop", out
        valid(engine.tokenizer, out.token_ids)


def test_an_unconstrained_request_batched_with_constrained_ones_is_unchanged(
    make_engine, tokenizer_model_dir, hf_greedy
):
    engine = make_engine(tokenizer_model_dir)
    ids = prompt(10, 99, 4096)
    plain = Request("plain", ids, greedy(16))
    mixed = [plain, *(Request(f"c{i}", prompt(12, i, 4096), sampled(i)) for i in range(4))]
    results = run_to_completion(engine, mixed)
    assert results["plain"].token_ids == hf_greedy(tokenizer_model_dir, ids, 16)
    for i in range(4):
        valid(engine.tokenizer, results[f"c{i}"].token_ids)


def test_the_grammar_state_crosses_the_kv_hop(make_engine, tokenizer_model_dir):
    pre, dec = make_engine(tokenizer_model_dir), make_engine(tokenizer_model_dir)
    for i in range(5):
        tokens = disaggregated(pre, dec, f"d{i}", prompt(12, i, 4096), sampled(100 + i))
        valid(pre.tokenizer, tokens)


def test_a_migrated_constrained_request_goes_on_inside_its_grammar(
    make_engine, tokenizer_model_dir
):
    engine = make_engine(tokenizer_model_dir)
    ids = prompt(12, 5, 4096)
    whole = run_to_completion(engine, [Request("w", ids, sampled(7))])["w"].token_ids
    for cut in (1, len(whole) // 2, len(whole) - 1):
        resumed = Request(f"m{cut}", ids, sampled(7), output_token_ids=tuple(whole[:cut]))
        engine.add_request(resumed)
        rest = drive(engine)[f"m{cut}"].token_ids
        assert whole[:cut] + rest == whole  # seeded: the same draws, the same state


def test_a_resumed_output_outside_the_constraint_is_refused(make_engine, tokenizer_model_dir):
    engine = make_engine(tokenizer_model_dir)
    bad = tuple(engine.tokenizer.encode("not json"))
    with pytest.raises(InvalidArgument):
        engine.add_request(Request("x", prompt(8, 1, 4096), sampled(1), output_token_ids=bad))
    assert not engine.has_work()


@pytest.mark.parametrize(
    ("so", "allowed"),
    [
        (StructuredOutput.choice(["alpha", "beta", "gamma"]), {"alpha", "beta", "gamma"}),
        (StructuredOutput("regex", "[0-9]{3}-[a-z]{2}"), None),
    ],
)
def test_choice_and_regex_constrain_greedy_and_sampled_rows(
    make_engine, tokenizer_model_dir, so, allowed
):
    engine = make_engine(tokenizer_model_dir)
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, structured=so),
        *(SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured=so) for s in range(4)),
    ]
    reqs = [Request(f"q{i}", prompt(8, i, 4096), p) for i, p in enumerate(params)]
    results = run_to_completion(engine, reqs)
    for r in reqs:
        text = engine.tokenizer.decode(results[r.request_id].token_ids, skip_special_tokens=True)
        if allowed is not None:
            assert text in allowed
        else:
            assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
