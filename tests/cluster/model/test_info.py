"""`ModelInfo.check_request` refuses a request whose prompt and `max_tokens` do not fit the
context together, naming both numbers; `default_max_tokens` fits an omitted `max_tokens` to
what the context leaves, so leaving it to the server never makes a long prompt fail."""

from __future__ import annotations

import pytest

from cluster.config import ModelConfig
from cluster.errors import InvalidArgument
from cluster.model.info import describe_model
from tests.conftest import greedy, prompt

SERVER_DEFAULT = 16


@pytest.fixture(scope="module")
def info(model_dir):
    return describe_model(ModelConfig(str(model_dir("llama-gqa"))))


@pytest.fixture(scope="module")
def context(info) -> int:
    return info.max_model_len


@pytest.mark.parametrize("prompt_tokens", [1, 40])
def test_prompt_plus_max_tokens_equal_to_the_context_is_accepted(info, context, prompt_tokens):
    info.check_request(prompt(prompt_tokens, seed=1), greedy(context - prompt_tokens))


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens"),
    [
        pytest.param(40, None, id="one-over"),  # context - 40 + 1
        pytest.param(1, None, id="one-token-prompt"),
        pytest.param(40, 2**31 - 1, id="int32-max"),
    ],
)
def test_prompt_plus_max_tokens_over_the_context_is_refused_naming_both(
    info, context, prompt_tokens, max_tokens
):
    max_tokens = max_tokens or context - prompt_tokens + 1
    with pytest.raises(InvalidArgument) as err:
        info.check_request(prompt(prompt_tokens, seed=1), greedy(max_tokens))
    message = str(err.value)
    assert err.value.param == "max_tokens"
    assert f"context is {context} tokens" in message
    assert f"needs {prompt_tokens + max_tokens} " in message
    assert f"({prompt_tokens} in the prompt + {max_tokens} max_tokens)" in message
    assert f"at most {context - prompt_tokens}" in message


def test_a_prompt_that_fills_the_context_is_refused_as_the_prompt(info, context):
    for length in (context, context + 7):
        with pytest.raises(InvalidArgument) as err:
            info.check_request(prompt(length, seed=2), greedy(1))
        assert err.value.param == "prompt"
        assert f"context is {context} tokens" in str(err.value) and str(length) in str(err.value)


def test_a_bad_prompt_is_named_before_max_tokens(info, context):
    with pytest.raises(InvalidArgument) as err:
        info.check_request((1, info.spec.vocab_size), greedy(context))
    assert err.value.param == "prompt_token_ids"


@pytest.mark.parametrize(
    ("left", "want"),
    [
        pytest.param(100, SERVER_DEFAULT, id="short-prompt-gets-the-server-default"),
        pytest.param(SERVER_DEFAULT, SERVER_DEFAULT, id="exactly-room-for-the-default"),
        pytest.param(SERVER_DEFAULT - 1, SERVER_DEFAULT - 1, id="cut-to-what-is-left"),
        pytest.param(1, 1, id="one-token-left"),
    ],
)
def test_an_omitted_max_tokens_fits_what_the_context_leaves(info, context, left, want):
    ids = prompt(context - left, seed=3)  # leaves `left` tokens of the context
    max_tokens = info.default_max_tokens(ids, SERVER_DEFAULT)
    assert max_tokens == want
    info.check_request(ids, greedy(max_tokens))  # fits: accepted


def test_an_omitted_max_tokens_leaves_a_full_prompt_to_be_refused_as_the_prompt(info, context):
    ids = prompt(context, seed=4)
    assert info.default_max_tokens(ids, SERVER_DEFAULT) == 1  # still a valid max_tokens
    with pytest.raises(InvalidArgument) as err:
        info.check_request(ids, greedy(info.default_max_tokens(ids, SERVER_DEFAULT)))
    assert err.value.param == "prompt"
