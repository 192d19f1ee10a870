"""Structured output end to end with the official openai client on the disaggregated app:
every sampled answer constrained by a JSON schema is valid JSON for it (the grammar state
crosses the KV hop by replay), and an unconstrained request batched with them is unchanged."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.ray_fixtures import wait_for_idle

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "the weather, as JSON"}]


def test_json_schema_answers_are_valid_and_a_plain_request_beside_them_is_unchanged(apps):
    client = openai.OpenAI(base_url=f"{apps.http_base}/pd/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}

    def constrained(seed: int):
        return client.chat.completions.create(
            model="",
            messages=MESSAGES,
            max_tokens=96,
            temperature=1.0,
            seed=seed,
            response_format=fmt,
        )

    def plain():
        return (
            client.chat.completions.create(
                model="", messages=MESSAGES, max_tokens=12, temperature=0.0
            )
            .choices[0]
            .message.content
        )

    alone = plain()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(constrained, seed) for seed in range(20)]
        beside = pool.submit(plain)  # in the same batches as the constrained ones
        answers = [f.result() for f in futures]
        beside = beside.result()
    assert beside == alone
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    wait_for_idle(apps, "pd", {"prefill", "decode"})
