"""Grammar masks on the project's own tokenizer: whatever the logits, a masked output matches
its constraint; a state rebuilt by replaying the output equals the one that wrote it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from cluster.engine.grammar import GrammarCompiler, apply_masks, check
from cluster.errors import InvalidArgument
from cluster.model.tokenizer_factory import write_tokenizer
from cluster.structured_output import StructuredOutput

pytest.importorskip("xgrammar")

VOCAB = 4096
EOS = 1
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, VOCAB, 2048)
    tok = AutoTokenizer.from_pretrained(folder)
    return tok, GrammarCompiler(tok, VOCAB, [EOS])


def _write(compiler, so, seed, greedy, limit=400):
    """Random logits through the mask until the grammar ends; the output tokens."""
    _, comp = compiler
    state = comp.state(so)
    gen = torch.Generator().manual_seed(seed)
    out = []
    while not state.done and len(out) < limit:
        logits = torch.randn(1, VOCAB, generator=gen) * 4
        apply_masks(logits, [state])
        probs = torch.softmax(logits, -1)
        token = int(logits.argmax()) if greedy else int(torch.multinomial(probs, 1, generator=gen))
        assert state.advance(token)
        out.append(token)
    assert state.done, "the grammar did not finish within the limit"
    assert out[-1] == EOS
    return out


def _text(compiler, tokens):
    return compiler[0].decode(tokens[:-1])


@pytest.mark.parametrize("greedy", [True, False])
def test_a_masked_output_is_json_valid_for_its_schema(compiler, greedy):
    for seed in range(10):
        text = _text(compiler, _write(compiler, StructuredOutput.schema(SCHEMA), seed, greedy))
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_grammar_constrain_the_text(compiler):
    cases = [
        (StructuredOutput("regex", r"[a-c]{2,5}-\d{3}"), r"[a-c]{2,5}-\d{3}"),
        (StructuredOutput.choice(["yes", "no", "it depends"]), r"yes|no|it depends"),
        (StructuredOutput("grammar", 'root ::= "(" [0-9] ("+" [0-9])? ")"'), r"\(\d(\+\d)?\)"),
    ]
    for so, pattern in cases:
        for seed in range(5):
            text = _text(compiler, _write(compiler, so, seed, greedy=False, limit=60))
            assert re.fullmatch(pattern, text), (so.kind, text)


def test_a_state_rebuilt_by_replay_allows_exactly_what_the_writer_allows(compiler):
    so = StructuredOutput.schema(SCHEMA)
    tokens = _write(compiler, so, seed=3, greedy=False)
    _, comp = compiler
    writer = comp.state(so)
    for n, token in enumerate(tokens[:-1]):
        replayed = comp.state(so, replay=tokens[:n])
        a, b = torch.zeros(1, VOCAB), torch.zeros(1, VOCAB)
        apply_masks(a, [writer])
        apply_masks(b, [replayed])
        assert torch.equal(a, b), f"masks differ after {n} tokens"
        writer.advance(token)


def test_only_constrained_rows_are_masked(compiler):
    _, comp = compiler
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    apply_masks(logits, [None, comp.state(StructuredOutput.choice(["x"])), None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isinf(logits[1]).sum() > VOCAB - 10


def test_a_replay_the_constraint_refuses_is_an_invalid_argument(compiler):
    tok, comp = compiler
    with pytest.raises(InvalidArgument, match="does not match"):
        comp.state(StructuredOutput.choice(["yes"]), replay=tok.encode("no"))


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutput("regex", "(unclosed"),
        StructuredOutput("grammar", "root ::= "),
        StructuredOutput("json_schema", '{"type": "no-such-type"}'),
    ],
)
def test_a_bad_constraint_is_refused_before_compiling(so):
    with pytest.raises(InvalidArgument) as e:
        check(so)
    assert e.value.param == "structured_outputs"


@pytest.mark.parametrize(
    ("kind", "spec"),
    [("choice", "[]"), ("choice", '["a", 3]'), ("json_schema", "[1]"), ("regex", ""), ("x", "")],
)
def test_a_malformed_constraint_is_refused_when_built(kind, spec):
    with pytest.raises(InvalidArgument):
        StructuredOutput(kind, spec)
