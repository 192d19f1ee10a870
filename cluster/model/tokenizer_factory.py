"""A deterministic byte-level BPE tokenizer whose vocabulary is exactly a model's vocab_size.

Random-weight checkpoints can emit any id below vocab_size, so every id must decode: the
vocabulary is the special tokens (ids 0-3), the 256 byte-level symbols, then merges learned from
a synthetic English-ish corpus generated in code, topped up with synthetic merges of existing
tokens if training stops short. Nothing is downloaded; the same vocab_size gives the same files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Their ids are their positions: 0, 1, 2, 3.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

# ChatML. No BOS is added anywhere: neither by encode() nor by the template.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS_SEED = 20240601
_COMMON_WORDS = (
    "the of and to in is was that for it with as on be at by this had not are but from or have "
    "an they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did "
    "many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three hello model token server request"
).split()
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v")
_ONSETS += ("w", "y", "z", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "pl", "pr", "sh", "sl")
_ONSETS += ("st", "str", "th", "tr", "wh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "ie", "oa", "oo", "ou", "y")
_CODAS = ("", "b", "d", "ck", "ft", "g", "l", "ll", "m", "n", "nd", "ng", "nt", "p", "r", "rd")
_CODAS += ("rt", "s", "ss", "st", "t", "th", "x")
_PUNCTUATION = (".", ".", ".", ",", "!", "?", ";", ":")


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, special tokens first."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    draft = Tokenizer(models.BPE())
    draft.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    draft.train_from_iterator(_synthetic_corpus(vocab_size), trainer)
    trained = json.loads(draft.to_str())["model"]
    vocab: dict[str, int] = trained["vocab"]
    merges = [(a, b) for a, b in trained["merges"]]
    _top_up(vocab, merges, vocab_size)
    _check(vocab, merges, vocab_size)

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    if tokenizer.get_vocab_size() != vocab_size:
        raise AssertionError(f"built {tokenizer.get_vocab_size()} ids, wanted {vocab_size}")
    return tokenizer


def write_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    tokenizer = build_tokenizer(vocab_size)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", "utf-8")
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        **special_map,
    }
    _write_json(out_dir / "special_tokens_map.json", special_map)
    _write_json(out_dir / "tokenizer_config.json", config)


def _synthetic_corpus(vocab_size: int) -> Iterator[str]:
    """Lines of pseudo-English: common words plus a Zipf-weighted lexicon of syllable words."""
    rng = random.Random(_CORPUS_SEED)
    syllables = [o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS]
    lexicon = dict.fromkeys(_COMMON_WORDS)
    while len(lexicon) < vocab_size:  # one distinct word per id leaves enough pairs to merge
        lexicon["".join(rng.choices(syllables, k=rng.choice((1, 2, 2, 2, 3, 3, 4))))] = None
    words = list(lexicon)
    cum_weights, total = [], 0.0
    for rank in range(len(words)):
        total += 1.0 / (rank + 2)
        cum_weights.append(total)
    for _ in range(vocab_size // 2):
        line = rng.choices(words, cum_weights=cum_weights, k=12)
        line[0] = line[0].capitalize()
        yield f"{' '.join(line)}{rng.choice(_PUNCTUATION)} {rng.randrange(2000)}"
    yield from words  # every lexicon word at least once


def _top_up(vocab: dict[str, int], merges: list[tuple[str, str]], vocab_size: int) -> None:
    """Append merges of existing non-special tokens, in id order, until vocab_size is reached."""
    specials = set(SPECIAL_TOKENS)
    while len(vocab) < vocab_size:
        pieces = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in specials]
        for a in pieces:
            for b in pieces:
                if len(vocab) == vocab_size:
                    return
                if a + b not in vocab:
                    vocab[a + b] = len(vocab)
                    merges.append((a, b))


def _check(vocab: dict[str, int], merges: list[tuple[str, str]], vocab_size: int) -> None:
    if sorted(vocab.values()) != list(range(vocab_size)):
        raise AssertionError("token ids are not exactly 0..vocab_size-1")
    for i, token in enumerate(SPECIAL_TOKENS):
        if vocab.get(token) != i:
            raise AssertionError(f"{token} must have id {i}")
    for a, b in merges:
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise AssertionError(f"merge {a!r} + {b!r} refers to a missing token")


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")
