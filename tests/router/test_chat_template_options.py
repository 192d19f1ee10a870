"""Chat template options: a request's `chat_template_kwargs` over the server's defaults,
`add_generation_prompt`, `continue_final_message` and the server's own `--chat-template`,
through the API and rendered by the real tokenizer."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from cluster.errors import InvalidArgument
from router.chat.chat_plan import ChatOptions
from router.prompt_tokenizer import PromptTokenizer, TemplateCall
from tests.router.fake_service import CHAT, assert_error


def test_request_kwargs_go_over_the_servers_defaults(client, fake):
    fake.chat_options = ChatOptions(template_kwargs={"enable_thinking": False, "x": 1})
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": True}}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert fake.template.kwargs == {"enable_thinking": True, "x": 1}
    assert fake.template.add_generation_prompt and not fake.template.continue_final_message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),  # with the default True
    ],
)
def test_conflicting_template_options_are_400(client, fake, fields, param):
    r = client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert_error(r, 400, "invalid_request_error", param)
    assert fake.opened == 0


@pytest.fixture(scope="module")
def prompts(tokenizer_model_dir) -> PromptTokenizer:
    return PromptTokenizer(AutoTokenizer.from_pretrained(tokenizer_model_dir), 2048)


def _render(prompts, messages, template) -> str:
    ids = asyncio.run(prompts.chat(messages, None, template))
    return prompts.tokenizer.decode(ids)


def test_the_servers_template_and_kwargs_render_the_prompt(prompts):
    own = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    own += "{% if add_generation_prompt %}>{% endif %}"
    messages = [{"role": "user", "content": "abc"}]
    assert _render(prompts, messages, TemplateCall({"greeting": "hi "}, True, False, own)) == (
        "hi [abc]>"
    )
    assert _render(prompts, messages, TemplateCall({"greeting": ""}, False, False, own)) == "[abc]"


def test_the_servers_template_serves_a_model_without_one(tokenizer_model_dir):
    bare = AutoTokenizer.from_pretrained(tokenizer_model_dir)
    bare.chat_template = None
    prompts = PromptTokenizer(bare, 2048)
    messages = [{"role": "user", "content": "abc"}]
    with pytest.raises(InvalidArgument, match="no chat template"):
        asyncio.run(prompts.chat(messages))
    own = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    assert _render(prompts, messages, TemplateCall({}, True, False, own)) == "<abc>"


def test_continue_final_message_leaves_the_last_turn_open(prompts):
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "The answer is"},
    ]
    text = _render(prompts, messages, TemplateCall({}, False, True))
    assert text.endswith("The answer is")  # no end-of-turn token after it
    closed = _render(prompts, messages, TemplateCall({}, False, False))
    assert closed.startswith(text) and len(closed) > len(text)
