"""The chat-application endpoints on the disaggregated app, with the official openai client:
a tool call round trip through `tool_choice: required` (a parseable call from a random-weight
model, and its result sent back), `/tokenize` equal to the tokenizer, `/detokenize`, and one
model by id."""

from __future__ import annotations

import json

import openai
import pytest
import requests
from transformers import AutoTokenizer

from tests.ray_fixtures import wait_for_idle

pytest.importorskip("xgrammar")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["paris", "oslo", "rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


def test_a_required_tool_call_round_trip(apps):
    client = openai.OpenAI(base_url=f"{apps.http_base}/pd/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "weather?"}]
    for seed in range(3):
        first = client.chat.completions.create(
            model="",
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=400,
            temperature=1.0,
            seed=seed,
        ).choices[0]
        assert first.finish_reason == "tool_calls", first
        (call,) = first.message.tool_calls[:1]
        assert call.function.name == "get_weather" and call.id
        args = json.loads(call.function.arguments)
        assert args["city"] in ("paris", "oslo", "rome") and 1 <= args["days"] <= 9
        reply = client.chat.completions.create(
            model="",
            messages=[
                *messages,
                first.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
            ],
            tools=[WEATHER],
            tool_choice="none",
            max_tokens=4,
            temperature=0.0,
        )
        assert reply.choices[0].message.tool_calls is None
        assert reply.usage.completion_tokens > 0
    wait_for_idle(apps, "pd", {"prefill", "decode"})


def test_tokenize_equals_the_tokenizer_and_detokenize_inverts_it(apps, tokenizer_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_model_dir)
    text = "Hello there, tokenizer!"
    with requests.Session() as http:
        r = http.post(f"{apps.http_base}/pd/tokenize", json={"prompt": text}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        r = http.post(
            f"{apps.http_base}/pd/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30
        )
        assert r.status_code == 200 and r.json()["prompt"] == text
        models = http.get(f"{apps.http_base}/pd/v1/models", timeout=30).json()["data"]
        r = http.get(f"{apps.http_base}/pd/v1/models/{models[0]['id']}", timeout=30)
        assert r.status_code == 200 and r.json()["id"] == models[0]["id"]
