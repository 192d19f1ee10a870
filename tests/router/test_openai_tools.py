"""Tool calls and reasoning through the OpenAI chat API, with the official client, on fixed
model texts (the service double streams a scripted answer): whole and streamed answers give the
same calls; `required` and a named tool constrain the request; bad tool settings are 400."""

from __future__ import annotations

import json

import pytest

from cluster.structured_output import StructuredOutput
from router.chat.chat_plan import ChatOptions
from tests.router.fake_service import CHAT, assert_error

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
HERMES = ChatOptions(tool_call_parser="hermes", enable_auto_tool_choice=True)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(oai, **kw) -> tuple[str, str, list[tuple[str, dict]], str]:
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in oai.chat.completions.create(model="", messages=MESSAGES, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for d in delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function.name:
                    assert d.id and d.type == "function"
                    entry["name"] = d.function.name
                entry["arguments"] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    return content, reasoning, got, reason


def test_an_auto_tool_call_is_read_whole_and_streamed(oai, fake):
    fake.chat_options = HERMES
    fake.script = (
        'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    whole = oai.chat.completions.create(model="", messages=MESSAGES, tools=[WEATHER])
    choice = whole.choices[0]
    assert _calls(choice.message) == [("get_weather", {"city": "Paris"})]
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    assert fake.tools == [WEATHER]  # the template saw the tools
    content, _, calls, reason = _streamed(oai, tools=[WEATHER])
    assert (content, calls, reason) == (
        "Checking.",
        [("get_weather", {"city": "Paris"})],
        "tool_calls",
    )


def test_without_tool_calls_the_answer_is_content(oai, fake):
    fake.chat_options = HERMES
    fake.script = "It is sunny."
    whole = oai.chat.completions.create(model="", messages=MESSAGES, tools=[WEATHER])
    assert whole.choices[0].message.content == "It is sunny."
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "stop"


def test_required_constrains_the_answer_to_a_list_of_calls(oai, fake):
    fake.script = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    whole = oai.chat.completions.create(
        model="", messages=MESSAGES, tools=[WEATHER], tool_choice="required"
    )
    assert _calls(whole.choices[0].message) == [("get_weather", {"city": "Oslo"})]
    so = fake.requests[-1].params.structured
    assert so.kind == "json_schema" and json.loads(so.spec)["minItems"] == 1
    _, _, calls, reason = _streamed(oai, tools=[WEATHER], tool_choice="required")
    assert calls == [("get_weather", {"city": "Oslo"})] and reason == "tool_calls"


def test_a_named_tool_constrains_the_answer_to_its_parameters(oai, fake):
    fake.script = '{"city": "Rome"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = oai.chat.completions.create(
        model="", messages=MESSAGES, tools=[WEATHER], tool_choice=named
    )
    assert _calls(whole.choices[0].message) == [("get_weather", {"city": "Rome"})]
    params = WEATHER["function"]["parameters"]
    assert fake.requests[-1].params.structured == StructuredOutput.schema(params)


def test_reasoning_is_split_from_the_content(oai, fake):
    fake.chat_options = ChatOptions(reasoning_parser="qwen3")
    fake.script = "<think>2 and 2</think>It is 4."
    message = oai.chat.completions.create(model="", messages=MESSAGES).choices[0].message
    assert (message.reasoning_content, message.content) == ("2 and 2", "It is 4.")
    content, reasoning, _, _ = _streamed(oai)
    assert (reasoning, content) == ("2 and 2", "It is 4.")


def test_earlier_calls_and_tool_results_reach_the_template(client, fake):
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={**CHAT, "messages": messages, "tools": [WEATHER], "tool_choice": "none"},
    )
    assert r.status_code == 200, r.text
    assert fake.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert fake.messages[2]["tool_call_id"] == "c1"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER]}, "tool_choice"),  # auto, but the server reads no calls
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, "tools"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
    ],
)
def test_bad_tool_settings_are_400(client, fake, fields, param):
    r = client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert_error(r, 400, "invalid_request_error", param)
    assert fake.opened == 0
