"""The app's chat settings are checked when the router starts: unknown parser names fail it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from router.chat.chat_plan import ChatOptions, chat_options


def _config(tool="", auto=False, reasoning="", kwargs=""):
    return SimpleNamespace(
        tool_call_parser=tool,
        enable_auto_tool_choice=auto,
        reasoning_parser=reasoning,
        chat_template="",
        default_chat_template_kwargs=kwargs,
    )


def test_known_parsers_are_taken():
    options = chat_options(_config("mistral", True, "deepseek_r1", '{"enable_thinking": false}'))
    assert options == ChatOptions("mistral", True, "deepseek_r1", "", {"enable_thinking": False})


@pytest.mark.parametrize(("tool", "reasoning"), [("nope", ""), ("", "nope")])
def test_an_unknown_parser_fails_with_the_known_names(tool, reasoning):
    with pytest.raises(ValueError, match="known"):
        chat_options(_config(tool, True, reasoning))
