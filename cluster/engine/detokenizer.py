"""Incremental detokenization with stop strings.

Text is decoded from a sliding window of tokens, so a multi-byte character split across tokens
is emitted only once it is whole (a window ending in U+FFFD waits for more tokens). Stop strings
are matched on the text so far; the tail that could still be the start of a stop string is held
back, and a matched stop string is cut off and never returned.

This runs per sequence on every engine step, so the windows go straight to the `tokenizers`
(Rust) backend where transformers' `decode` would only wrap it (`window_decoder`): the same
text at a third of the cost.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase, TokenizersBackend

_REPLACEMENT = "\ufffd"


def window_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)`: the Rust tokenizer's own when transformers' `decode`
    adds nothing to it (a `TokenizersBackend` that overrides no decoding and cleans up no
    spaces), else transformers'."""
    cls = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is TokenizersBackend.decode
        and cls._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    return tokenizer.backend_tokenizer.decode if plain else tokenizer.decode


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        resumed: tuple[int, ...] = (),
    ) -> None:
        """`resumed`: output tokens already decoded (and their text streamed) elsewhere; they
        are replayed, so text held back for a stop string there stays held here."""
        self.decode = window_decoder(tokenizer)
        self.tokens = list(prompt_token_ids[-6:])  # context for spacing rules, never emitted
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text decoded so far (before any stop cut)
        self.emitted = 0  # chars of `text` already handed out
        for token_id in resumed:  # a stop string among them would have ended the generation
            self.add(token_id)
        self.take(final=False)

    def add(self, token_id: int) -> bool:
        """Add one output token. Returns True if a stop string has now appeared."""
        tokens, start = self.tokens, self.prefix_offset
        tokens.append(token_id)
        prefix = self.decode(tokens[start : self.read_offset], True)  # True: skip special tokens
        full = self.decode(tokens[start:], True)
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        if not self.stop:
            return False
        start = max(0, self.emitted - self.hold - 1)
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def take(self, final: bool) -> str:
        """Text ready to emit: all of it when the sequence is done, else all but the held tail."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
