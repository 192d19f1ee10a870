"""Client text against the router's event loop (router/prompt_tokenizer.py), with the real
byte-level BPE tokenizer of `make_model`'s tiny checkpoint: text is bounded before it is
tokenized, a long prompt is tokenized off the loop (a coroutine ticking every 10 ms keeps
ticking), and what is tokenized equals the tokenizer's own `encode`."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest
from transformers import AutoTokenizer

from cluster.errors import InvalidArgument
from router.prompt_tokenizer import (
    INLINE_BYTES,
    MAX_BYTES_PER_TOKEN,
    MAX_CHAT_MESSAGES,
    PromptTokenizer,
)

CONTEXT = 2048
FOUR_MB = 4_000_000
WORDS = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def tokenizer(tokenizer_model_dir):
    return AutoTokenizer.from_pretrained(tokenizer_model_dir)


def _sync(test):
    """Run an async test on a loop of its own (the suite has no asyncio plugin)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


def text(n_bytes: int) -> str:
    return (WORDS * (n_bytes // len(WORDS) + 1))[:n_bytes]


async def largest_gap(work) -> tuple[object, float, float]:
    """Run `work` (a coroutine) beside a coroutine that wakes every 10 ms: (its result or the
    exception it raised, how long it took, the largest gap the ticker saw)."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.03)
    start = time.perf_counter()
    try:
        result = await work
    except Exception as e:
        result = e
    took = time.perf_counter() - start
    done.set()
    await ticker
    return result, took, max(gaps)


@_sync
async def test_a_4mb_prompt_is_refused_at_once_naming_the_prompt(tokenizer):
    prompts = PromptTokenizer(tokenizer, CONTEXT)
    error, took, gap = await largest_gap(prompts.encode(text(FOUR_MB)))
    assert isinstance(error, InvalidArgument) and error.param == "prompt"
    assert (
        f"{FOUR_MB} bytes" in error.message and str(CONTEXT * MAX_BYTES_PER_TOKEN) in error.message
    )
    assert took < 0.2 and gap < 0.5, (took, gap)


@_sync
async def test_a_long_prompt_is_tokenized_off_the_loop(tokenizer):
    """512 KiB, within the bound of a 64k context: tokenized on the loop it holds the loop for
    about a second or more (on a loaded 2-core machine); off it the ticker keeps going."""
    prompt = text(512 << 10)
    prompts = PromptTokenizer(tokenizer, 1 << 16)
    try:
        ids, took, gap = await largest_gap(prompts.encode(prompt))
    finally:
        prompts.close()
    assert ids == tokenizer.encode(prompt, add_special_tokens=False)
    assert gap < 0.5, (took, gap)


@pytest.mark.parametrize("n_bytes", [1, INLINE_BYTES, INLINE_BYTES + 1, 20_000])
@_sync
async def test_tokens_equal_the_tokenizers_on_and_off_the_loop(tokenizer, n_bytes):
    prompts = PromptTokenizer(tokenizer, CONTEXT)
    prompt = text(n_bytes)
    assert await prompts.encode(prompt) == tokenizer.encode(prompt, add_special_tokens=False)
    prompts.close()


@_sync
async def test_the_byte_bound_is_inclusive(tokenizer):
    prompts = PromptTokenizer(tokenizer, 64)
    limit = 64 * MAX_BYTES_PER_TOKEN
    assert len(await prompts.encode(text(limit))) > 0
    with pytest.raises(InvalidArgument):
        await prompts.encode(text(limit + 1))
    with pytest.raises(InvalidArgument):  # counted in UTF-8 bytes, not characters
        await prompts.encode("é" * (limit // 2 + 1))


@pytest.mark.parametrize("prompt", ["abc\ud800", "\udfff", "x" * 5000 + "\ud83d"])
@_sync
async def test_a_lone_surrogate_is_refused_naming_the_field(tokenizer, prompt):
    with pytest.raises(InvalidArgument, match="not valid Unicode") as e:
        await PromptTokenizer(tokenizer, CONTEXT).encode(prompt)
    assert e.value.param == "prompt"


@_sync
async def test_chat_is_bounded_before_it_is_rendered(tokenizer):
    prompts = PromptTokenizer(tokenizer, CONTEXT)
    one = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(one, tokenize=False, add_generation_prompt=True)
    assert await prompts.chat(one) == tokenizer.encode(rendered, add_special_tokens=False)
    cases = [
        one * (MAX_CHAT_MESSAGES + 1),
        [{"role": "user", "content": text(FOUR_MB)}],
        [{"role": "user", "content": text(FOUR_MB // 8)}] * 8,  # large together
        [{"role": "user", "content": "hi \ud800"}],
    ]
    for messages in cases:
        error, took, gap = await largest_gap(prompts.chat(messages))
        assert isinstance(error, InvalidArgument) and error.param == "messages", error
        assert took < 0.2 and gap < 0.5, (took, gap)


@_sync
async def test_a_rendered_chat_past_the_bound_is_refused(tokenizer):
    """Contents just under the bound; the template's own text takes the chat past it."""
    prompts = PromptTokenizer(tokenizer, 64)
    content = text(64 * MAX_BYTES_PER_TOKEN - 2)
    with pytest.raises(InvalidArgument, match="messages is") as e:
        await prompts.chat([{"role": "user", "content": content}])
    assert e.value.param == "messages"


@_sync
async def test_without_a_tokenizer_text_is_refused():
    with pytest.raises(InvalidArgument, match="no tokenizer"):
        await PromptTokenizer(None, CONTEXT).encode("hi")
    with pytest.raises(InvalidArgument, match="no chat template"):
        await PromptTokenizer(None, CONTEXT).chat([{"role": "user", "content": "hi"}])
