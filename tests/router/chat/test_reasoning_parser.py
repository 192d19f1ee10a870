"""Reasoning split from content on fixed texts, whole and streamed split anywhere."""

from __future__ import annotations

import random

import pytest

from router.chat import REASONING_PARSERS, ReasoningStream

CASES = [
    (
        "qwen3",
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        "\nLet me think.\n",
        "\n\nThe answer is 4.",
    ),
    ("qwen3", "The answer is 4.", None, "The answer is 4."),
    ("qwen3", "<think>still thinking when cut", "still thinking when cut", None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "a </think> b", None, "a </think> b"),
    ("deepseek_r1", "Hmm, 2+2.</think>It is 4.", "Hmm, 2+2.", "It is 4."),
    ("deepseek_r1", "<think>Hmm.</think>4", "Hmm.", "4"),
    ("deepseek_r1", "never closed", "never closed", None),
    ("deepseek_r1", "</think>only content", None, "only content"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_a_whole_answer_splits_reasoning_from_content(name, text, reasoning, content):
    assert REASONING_PARSERS[name].parse(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_a_stream_split_anywhere_gives_the_same_parts(name, text, reasoning, content):
    rng = random.Random(0)
    splits = [list(text), [text]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in splits:
        stream = ReasoningStream(REASONING_PARSERS[name])
        got_r = got_c = ""
        for piece in pieces:
            r, c = stream.feed(piece)
            got_r, got_c = got_r + r, got_c + c
        r, c = stream.finish()
        assert (got_r + r or None, got_c + c or None) == (reasoning, content)


def test_reasoning_is_streamed_as_it_comes_not_held_to_the_end():
    stream = ReasoningStream(REASONING_PARSERS["qwen3"])
    assert stream.feed("<think>step one") == ("step one", "")
    assert stream.feed(", step two</thi") == (", step two", "")
    assert stream.feed("nk>done") == ("", "done")
