"""OpenAI's (and vLLM's) sampling fields over HTTP, against a `GenerationService` double: the
logit adjustments reach the request, from raw JSON and from the official client; bad values
and fields pdserve does not implement are a 400 naming the field, never silently ignored."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from router.openai_unsupported import OFF_VALUES, UnsupportedChatFields, UnsupportedCompletionFields
from tests.router.fake_service import CHAT, COMPLETION, MODEL, FakeService, assert_error

PATHS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}
ADJUSTMENTS = {
    "presence_penalty": 1.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.3,
    "min_p": 0.05,
    "logit_bias": {"17": -100, "4": 2.5},
}


@pytest.mark.parametrize("path", list(PATHS))
def test_logit_adjustments_reach_the_request(client, fake, path) -> None:
    r = client.post(path, json={**PATHS[path], **ADJUSTMENTS})
    assert r.status_code == 200, r.text
    p = fake.requests[-1].params
    assert p.logit_bias == ((4, 2.5), (17, -100.0))
    assert (p.presence_penalty, p.frequency_penalty) == (1.5, -0.5)
    assert (p.repetition_penalty, p.min_p) == (1.3, 0.05)


def test_the_official_client_sends_them(oai: openai.OpenAI, fake: FakeService) -> None:
    oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias={"9": 5},
        extra_body={"repetition_penalty": 1.1, "min_p": 0.2},
    )
    p = fake.requests[-1].params
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, 0.25, ((9, 5.0),))
    assert (p.repetition_penalty, p.min_p) == (1.1, 0.2)


def test_nulls_take_the_defaults(client, fake) -> None:
    nulls = dict.fromkeys(ADJUSTMENTS)
    assert client.post("/v1/completions", json={**COMPLETION, **nulls}).status_code == 200
    assert not fake.requests[-1].params.adjusts_logits


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("presence_penalty", -2.1, "[-2, 2]"),
        ("frequency_penalty", 3, "[-2, 2]"),
        ("repetition_penalty", 0, "[0.01, 100]"),
        ("repetition_penalty", -1.0, "[0.01, 100]"),
        ("repetition_penalty", 1e-40, "[0.01, 100]"),
        ("temperature", 100.5, "[0, 100]"),
        ("temperature", -1e-40, "[0, 100]"),
        ("min_p", 1.5, "[0, 1]"),
        ("min_p", -0.5, "[0, 1]"),
        ("logit_bias", {"5": 150}, "[-100, 100]"),
        ("logit_bias", {"512": 1}, "vocabulary"),  # the fake serves a 512-token vocabulary
        ("logit_bias", {"-3": 1}, "token ids"),
        ("logit_bias", {"hello": 1}, "token ids"),
        ("logit_bias", {"9" * 5000: 1}, "token ids"),  # past int()'s 4,300-digit limit
        ("logit_bias", {"1" + "0" * 10: 1}, "token ids"),
        ("logit_bias", {str(t): 1 for t in range(301)}, "at most 300"),
    ],
)
@pytest.mark.parametrize("path", list(PATHS))
def test_bad_values_are_400_naming_the_field(client, fake, path, field, value, words) -> None:
    r = client.post(path, json={**PATHS[path], field: value})
    error = assert_error(r, 400, "invalid_request_error", field)
    assert words in error["message"], error
    assert fake.opened == 0


CASES = [("/v1/completions", f) for f in UnsupportedCompletionFields.model_fields] + [
    ("/v1/chat/completions", f) for f in UnsupportedChatFields.model_fields
]
# A value that asks for something, per field.
SOMETHING: dict[str, object] = {
    "best_of": 2,
    "suffix": "tail",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "modalities": ["text", "audio"],
    "min_tokens": 3,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "bad_words": ["x"],
    "include_stop_str_in_output": True,
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "chat_template_kwargs": {"enable_thinking": True},
}


@pytest.mark.parametrize(("path", "field"), CASES)
def test_unimplemented_fields_are_400_naming_them(client, fake, path, field) -> None:
    value = SOMETHING.get(field, {"anything": 1})
    r = client.post(path, json={**PATHS[path], field: value})
    error = assert_error(r, 400, "invalid_request_error", field)
    assert "not supported" in error["message"] and field in error["message"]
    assert fake.opened == 0


@pytest.mark.parametrize(("path", "field"), CASES)
def test_unimplemented_fields_asking_for_nothing_are_accepted(client, path, field) -> None:
    for value in (None, *OFF_VALUES[field]):
        r = client.post(path, json={**PATHS[path], field: value})
        assert r.status_code == 200, (field, value, r.text)


def test_a_bool_does_not_stand_for_a_number(client: TestClient) -> None:
    r = client.post("/v1/completions", json={**COMPLETION, "best_of": True})
    assert_error(r, 400, "invalid_request_error", "best_of")


def test_every_unimplemented_field_is_declared_somewhere() -> None:
    declared = set(UnsupportedCompletionFields.model_fields) | set(
        UnsupportedChatFields.model_fields
    )
    assert declared == set(OFF_VALUES)
