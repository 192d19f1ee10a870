"""Incremental detokenization equals the full decode, never emits half a character, and cuts
stop strings (also ones spanning several tokens) without ever returning them."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from cluster.engine.detokenizer import IncrementalDetokenizer, window_decoder
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.conftest import run_to_completion

TEXT = "héllo wörld 你好 🙂"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_model_dir):
    return AutoTokenizer.from_pretrained(tokenizer_model_dir)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    """Feed `ids` one by one as the engine does; the deltas handed out, and whether a stop
    string ended the stream."""
    deltas = []
    for i, t in enumerate(ids):
        stopped = detok.add(t)
        deltas.append(detok.take(final=stopped or i == len(ids) - 1))
        if stopped:
            return deltas, True
    return deltas, False


def test_text_has_characters_split_across_tokens(tokenizer):
    """The premise: several characters of TEXT are spread over more than one token."""
    ids = _encode(tokenizer, TEXT)
    assert sum(REPLACEMENT in tokenizer.decode([t]) for t in ids) >= 6
    assert tokenizer.decode(ids) == TEXT


@pytest.mark.parametrize("context", ["", "Say:", "你"])
def test_incremental_equals_full_decode(tokenizer, context):
    prompt_ids = _encode(tokenizer, context)
    ids = _encode(tokenizer, TEXT)
    deltas, stopped = _stream(IncrementalDetokenizer(tokenizer, prompt_ids), ids)
    assert not stopped
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert not any(REPLACEMENT in d for d in deltas)
    assert sum(1 for d in deltas if d) >= 8  # streamed as it goes, not all at the end


def test_special_tokens_are_not_emitted(tokenizer):
    ids = _encode(tokenizer, "hi") + [tokenizer.eos_token_id]
    deltas, _ = _stream(IncrementalDetokenizer(tokenizer, []), ids)
    assert "".join(deltas) == "hi"


@pytest.mark.parametrize(
    ("stop", "want"),
    [
        (("wörld",), "héllo "),  # five tokens, two of them halves of "ö"
        (("你好",), "héllo wörld "),  # six tokens, all partial characters
        (("🙂", "o w"), "héll"),  # the earliest match wins
        (("ll",), "hé"),
        (("h",), ""),
    ],
)
def test_stop_string_is_cut_and_never_returned(tokenizer, stop, want):
    ids = _encode(tokenizer, TEXT)
    deltas, stopped = _stream(IncrementalDetokenizer(tokenizer, [], stop), ids)
    assert stopped
    assert "".join(deltas) == want
    assert not any(REPLACEMENT in d for d in deltas)


def test_stop_string_prefix_is_held_back_then_released(tokenizer):
    """ "wörk" starts like "wörld": the text is held while it could still match, then let out."""
    ids = _encode(tokenizer, TEXT)
    detok = IncrementalDetokenizer(tokenizer, [], ("wörk",))
    emitted = ""
    for t in ids[:9]:  # up to "héllo wör"
        assert not detok.add(t)
        emitted += detok.take(final=False)
    assert emitted == "héllo "
    deltas, stopped = _stream(detok, ids[9:])
    assert not stopped
    assert emitted + "".join(deltas) == TEXT


def test_window_decoder_is_the_rust_decode_and_gives_transformers_text(tokenizer):
    """The detokenizer skips transformers' wrapper only where that wrapper adds nothing."""
    decode = window_decoder(tokenizer)
    assert decode == tokenizer.backend_tokenizer.decode
    rng = random.Random(0)
    for _ in range(300):  # windows of random ids, special tokens and partial characters too
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 8))]
        assert decode(ids, True) == tokenizer.decode(ids, skip_special_tokens=True)


def test_window_decoder_keeps_transformers_cleanup(tokenizer_model_dir):
    cleaning = AutoTokenizer.from_pretrained(tokenizer_model_dir, clean_up_tokenization_spaces=True)
    assert window_decoder(cleaning) == cleaning.decode


def _windows_only(detok: IncrementalDetokenizer) -> IncrementalDetokenizer:
    detok.stream = None  # as for a tokenizer whose decode transformers extends
    return detok


def test_the_backend_stream_gives_the_text_of_windows(tokenizer):
    """Random output ids (special tokens, partial characters) after random prompts whose text
    is whole: the backend's `DecodeStream` and the Python windows stream the same deltas, with
    and without a stop string."""
    rng = random.Random(0)
    decode = tokenizer.backend_tokenizer.decode
    compared = 0
    for _ in range(400):
        context = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 8))]
        if decode(context[-6:], skip_special_tokens=True).endswith(REPLACEMENT):
            continue
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 24))]
        stop = (decode(ids[3:5]),) if len(ids) > 6 and rng.random() < 0.3 else ()
        stream = IncrementalDetokenizer(tokenizer, context, stop)
        assert stream.stream is not None
        windows = _windows_only(IncrementalDetokenizer(tokenizer, context, stop))
        assert _stream(stream, ids) == _stream(windows, ids), (context, ids, stop)
        compared += 1
    assert compared > 300


def test_a_prompt_ending_mid_character_is_never_emitted(tokenizer):
    """Prompt ids that stop inside a character: none of the prompt's text comes out."""
    ids = _encode(tokenizer, "abc你")
    prompt_ids = ids[:-1]
    assert tokenizer.decode(prompt_ids).endswith(REPLACEMENT)  # the premise
    deltas, _ = _stream(IncrementalDetokenizer(tokenizer, prompt_ids), _encode(tokenizer, " ok"))
    assert "abc" not in "".join(deltas) and "".join(deltas).endswith(" ok")


def test_a_stream_that_fails_goes_on_in_windows(tokenizer):
    class Failing:
        def step(self, *_):
            raise Exception("InvalidPrefix")

    ids = _encode(tokenizer, " hello world, the quick brown fox")
    detok = IncrementalDetokenizer(tokenizer, _encode(tokenizer, "Say:"))
    head, _ = _stream(detok, ids[:3])
    detok.stream = Failing()
    tail, _ = _stream(detok, ids[3:])
    assert detok.stream is None
    assert "".join(head + tail) == tokenizer.decode(ids)


# -- through the engine -------------------------------------------------------------------


def _greedy(max_tokens: int, stop: tuple[str, ...] = ()) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=stop)


def test_engine_text_streams_and_cuts_stop_strings(tokenizer_model_dir, make_engine, tokenizer):
    engine = make_engine(tokenizer_model_dir, block_size=4)
    prompt_ids = tuple(_encode(tokenizer, "Once upon a time"))
    full = run_to_completion(engine, [Request("r", prompt_ids, _greedy(24))])["r"]
    text = tokenizer.decode(full.token_ids, skip_special_tokens=True)
    assert full.text == text.rstrip(REPLACEMENT)

    # A stop string from the middle of the output that spans at least two tokens.
    ends = [len(tokenizer.decode(full.token_ids[: i + 1])) for i in range(len(full.token_ids))]
    candidates = [
        (a, text[a : a + n])
        for a in range(3, len(text) - 6)
        for n in (4, 5, 6)
        if REPLACEMENT not in text[a : a + n] and text.find(text[a : a + n]) == a
        if any(a < e < a + n for e in ends)
    ]
    assert candidates, text
    start, stop = candidates[0]
    out = run_to_completion(engine, [Request("s", prompt_ids, _greedy(24, stop=(stop,)))])["s"]
    assert out.finish_reason == "stop"
    assert out.text == text[:start]
    assert stop not in out.text
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert stop in tokenizer.decode(out.token_ids) and stop not in tokenizer.decode(
        out.token_ids[:-1]
    )
