"""Incremental detokenization with stop strings.

Text is decoded from a sliding window of tokens, so a multi-byte character split across tokens
is emitted only once it is whole (a window ending in U+FFFD waits for more tokens). Stop strings
are matched on the text so far; the tail that could still be the start of a stop string is held
back, and a matched stop string is cut off and never returned.

This runs per sequence per engine step (on `AsyncEngine`'s output thread), so where
transformers' `decode` would only wrap the `tokenizers` (Rust) backend, the window is the
backend's own `DecodeStream`: one call per token, a quarter of the cost of two window decodes
from Python. Where transformers' decode does more (`window_decoder`), or a stream fails, the
window is kept here and decoded through transformers.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase, TokenizersBackend

_REPLACEMENT = "\ufffd"
_CONTEXT = 6  # prompt tokens decoded before the output, for spacing rules; never emitted


def plain_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust tokenizer when transformers' `decode` adds nothing to its own (a
    `TokenizersBackend` that overrides no decoding and cleans up no spaces), else None."""
    cls = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is TokenizersBackend.decode
        and cls._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    return tokenizer.backend_tokenizer if plain else None


def window_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)`: the Rust tokenizer's own where transformers' adds
    nothing to it, else transformers'."""
    backend = plain_backend(tokenizer)
    return backend.decode if backend is not None else tokenizer.decode


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
        self.backend = plain_backend(tokenizer)
        self.decode = tokenizer.decode if self.backend is None else self.backend.decode
        self.tokens = list(prompt_token_ids[-_CONTEXT:])  # context for spacing, never emitted
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stream = self._stream(self.tokens) if self.backend is not None else None
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text decoded so far (before any stop cut)
        self.emitted = 0  # chars of `text` already handed out
        for token_id in resumed:  # a stop string among them would have ended the generation
            self.add(token_id)
        self.take(final=False)

    def _stream(self, context: list[int]) -> DecodeStream:
        """The backend's stream after `context`. A context whose text ends mid-character would
        be emitted by the stream's first step, so its last tokens are left out until its text
        is whole (only a prompt given as token ids ends so)."""
        context = list(context)
        while context and self.decode(context, True).endswith(_REPLACEMENT):
            context.pop()
        return DecodeStream(ids=context, skip_special_tokens=True)

    def add(self, token_id: int) -> bool:
        """Add one output token. Returns True if a stop string has now appeared."""
        tokens = self.tokens
        tokens.append(token_id)
        if self.stream is not None:
            try:
                piece = self.stream.step(self.backend, token_id)
            except Exception:  # the stream's text did not extend its prefix: go on in windows
                self.stream = None
                self.prefix_offset = self.read_offset = len(tokens) - 1
                self._window()
            else:
                if piece:
                    self.text += piece
        else:
            self._window()
        if not self.stop:
            return False
        start = max(0, self.emitted - self.hold - 1)
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def _window(self) -> None:
        """Decode the window's new token: the text past the window's settled prefix, unless it
        ends mid-character."""
        tokens, start = self.tokens, self.prefix_offset
        prefix = self.decode(tokens[start : self.read_offset], True)  # True: skip special tokens
        full = self.decode(tokens[start:], True)
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(tokens)

    def take(self, final: bool) -> str:
        """Text ready to emit: all of it when the sequence is done, else all but the held tail."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
