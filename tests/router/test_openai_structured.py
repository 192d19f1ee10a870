"""Structured-output fields of the OpenAI API reach the request as one constraint; a bad or a
second constraint is a 400 naming its field, before any worker is touched."""

from __future__ import annotations

import json

import pytest

from cluster.structured_output import StructuredOutput
from tests.router.fake_service import CHAT, COMPLETION, assert_error

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PATHS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            StructuredOutput.schema(SCHEMA),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput.schema(SCHEMA)),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput("regex", "[a-z]+")),
        ({"structured_outputs": {"choice": ["y", "n"]}}, StructuredOutput.choice(["y", "n"])),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput.schema(SCHEMA)),
        ({"guided_choice": ["y", "n"]}, StructuredOutput.choice(["y", "n"])),
        (
            {"guided_grammar": 'root ::= "a" | "b"'},
            StructuredOutput("grammar", 'root ::= "a" | "b"'),
        ),
    ],
)
def test_each_constraint_field_reaches_the_request(client, fake, path, fields, want):
    r = client.post(path, json={**PATHS[path], **fields})
    assert r.status_code == 200, r.text
    assert fake.requests[-1].params.structured == want


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": 3}}, "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"nonsense": 1}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
        ),
    ],
)
def test_a_bad_or_second_constraint_is_400_naming_its_field(client, fake, fields, param):
    r = client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert_error(r, 400, "invalid_request_error", param)
    assert fake.opened == 0
