"""Tool-call parsers on fixed model texts of each format, whole and streamed: a stream split
anywhere sends exactly the whole answer's content and calls."""

from __future__ import annotations

import json
import random

import pytest

from router.chat import ToolCallStream, tool_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array"},
            },
        },
    },
}

# (parser, model text, expected content, expected [(name, arguments)])
CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich <3"}}',  # no close tag
        None,
        [("get_weather", {"city": "Zürich <3"})],
    ),
    (
        "hermes",
        "No tools needed: 1 < 2 and <tool is not a tag.",
        "No tools needed: 1 < 2 and <tool is not a tag.",
        [],
    ),
    (
        "hermes",
        "Broken <tool_call>{not json}</tool_call>",
        "Broken <tool_call>{not json}</tool_call>",
        [],
    ),
    (
        "qwen3_coder",
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
        "<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
        "Checking.\n",
        [("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [1, 2]})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n"
        "</tool_call>",
        None,
        [("get_weather", {"city": "42"})],  # a string parameter stays a string
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        None,
        [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Rome"}}',
        None,
        [("get_weather", {"city": "Rome"})],
    ),
    ("llama3_json", 'The answer is {"a": 1}.', 'The answer is {"a": 1}.', []),
    ("llama3_json", '{"just": "json"}', '{"just": "json"}', []),
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
        '{"name": "get_time", "arguments": {"tz": "UTC"}}]',
        "Sure. ",
        [("get_weather", {"city": "Lyon"}), ("get_time", {"tz": "UTC"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time[ARGS]{}',
        None,
        [("get_weather", {"city": "Nice"}), ("get_time", {})],
    ),
]


def _expect(message, content, calls):
    assert message.content == content
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_a_whole_answer_splits_into_content_and_calls(name, text, content, calls):
    _expect(tool_parser(name, [WEATHER]).parse(text), content, calls)


def _streamed(name, pieces):
    stream = ToolCallStream(tool_parser(name, [WEATHER]))
    content, deltas = "", []
    for piece in pieces:
        more, new = stream.feed(piece)
        content, deltas = content + more, deltas + new
    more, new = stream.finish()
    return content + more, deltas + new


def _splits(text, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_a_stream_split_anywhere_sends_the_whole_answers_parts(name, text, content, calls):
    for pieces in [list(text), [text], *(_splits(text, seed) for seed in range(20))]:
        sent, deltas = _streamed(name, pieces)
        assert sent == (content or "")
        # OpenAI's shape: per call, one delta with id and name, then its arguments
        rebuilt: dict[int, dict] = {}
        for d in deltas:
            entry = rebuilt.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
            entry["arguments"] += d.arguments
        assert sorted(rebuilt) == list(range(len(calls)))
        got = [(rebuilt[i]["name"], json.loads(rebuilt[i]["arguments"])) for i in sorted(rebuilt)]
        assert got == calls
        assert all(rebuilt[i]["id"] for i in rebuilt)


def test_content_is_sent_before_the_calls_complete():
    stream = ToolCallStream(tool_parser("hermes"))
    assert stream.feed("Hello there, ") == ("Hello there,", [])
    assert stream.feed('I will call.<tool_call>{"name": "f", "argu') == (" I will call.", [])
    content, deltas = stream.feed('ments": {"x": 1}}</tool_call>')
    assert content == "" and [d.name for d in deltas] == ["f", None]
    assert stream.called


def test_mistral_call_ids_are_nine_alphanumerics():
    message = tool_parser("mistral").parse('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    (call,) = message.tool_calls
    assert len(call.id) == 9 and call.id.isalnum()


def test_an_unknown_parser_name_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("nope")
