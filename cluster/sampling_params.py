"""Per-request sampling settings, validated once when the request is admitted."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from cluster.errors import InvalidArgument
from cluster.structured_output import StructuredOutput

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
# Bounds on stop conditions: every step checks each stop string against the new text, so an
# unbounded list is a per-token cost a single request could impose on its whole batch.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI
MAX_BIAS = 100.0  # logit_bias values lie in [-100, 100], as OpenAI
# A temperature below the floor is greedy (vLLM's 1e-5): dividing logits by a tinier one
# overflows them in float32. Above the ceiling sampling is uniform noise already.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
# repetition_penalty divides (or multiplies) a logit by at most 100: beyond that range the
# penalty no longer nudges, it bans or forces tokens, and with the temperature floor the
# adjusted logits stay far inside float32's range.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """`temperature == 0` is greedy, and so is one below `MIN_TEMPERATURE` (made 0 here).
    `top_k == 0` turns top-k off. `seed` makes sampling
    reproducible: the token drawn at output position i depends only on (seed, i) and the logits,
    never on the batch or the worker that ran the step."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Report each output token's log-probability and the `logprobs` most likely alternatives
    # (under the model's own distribution: raw logits, before any bias, penalty, temperature or
    # filter). None: off.
    logprobs: int | None = None
    # Logit adjustments, applied in this order before temperature (see cluster/engine/penalties):
    # `logit_bias` (token id, bias) pairs, sorted by token id (a mapping is accepted too);
    # `repetition_penalty` over prompt and output tokens (1.0: off); `frequency_penalty` and
    # `presence_penalty` over output tokens (0.0: off). `min_p` filters after top-k and top-p.
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    # The output must match this (a JSON schema, a regex, ...): tokens outside it are masked
    # before the draw (cluster/engine/grammar). None: unconstrained.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidArgument(
                f"max_tokens must be a positive integer, got {self.max_tokens}", param="max_tokens"
            )
        if not _number_in(self.temperature, 0.0, MAX_TEMPERATURE):
            raise InvalidArgument(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}",
                param="temperature",
            )
        if self.temperature < MIN_TEMPERATURE:  # frozen: normalised once, here
            object.__setattr__(self, "temperature", 0.0)
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}", param="top_k")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument(f"seed must be in [0, 2**63), got {self.seed}", param="seed")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop strings must be non-empty", param="stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(
                f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", param="stop"
            )
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidArgument(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters", param="stop"
            )
        if not all(_is_unicode(s) for s in self.stop):
            raise InvalidArgument("stop strings must be valid Unicode", param="stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
                param="stop_token_ids",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids must be >= 0", param="stop_token_ids")
        self._check_adjustments()

    def _check_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number_in(value, -MAX_PENALTY, MAX_PENALTY):
                raise InvalidArgument(
                    f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}",
                    param=name,
                )
        rp = self.repetition_penalty
        if not _number_in(rp, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):
            raise InvalidArgument(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}], got {rp}",
                param="repetition_penalty",
            )
        if not _number_in(self.min_p, 0.0, 1.0):
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        # Frozen: normalise the bias once, here, to sorted (int, float) pairs.
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse, naming the field, token ids this model's vocabulary does not have."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidArgument(
                f"logit_bias token ids out of vocabulary [0, {vocab_size}): {bad[:5]}",
                param="logit_bias",
            )

    @cached_property  # read per row on every step
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must change this request's logits before it picks a token."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.structured is not None
        )


def _is_unicode(text: str) -> bool:
    """Whether `text` has a UTF-8 form (a lone surrogate, which JSON can escape, has none)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _number_in(value: object, low: float, high: float) -> bool:
    """A real number (not a bool) in [low, high]; NaN is not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return low <= value <= high


def _bias_pairs(bias: Mapping | Iterable) -> tuple[tuple[int, float], ...]:
    items = list(bias.items() if isinstance(bias, Mapping) else bias)
    if len(items) > MAX_LOGIT_BIAS:
        raise InvalidArgument(
            f"logit_bias has {len(items)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias"
        )
    pairs: dict[int, float] = {}
    for token, value in items:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidArgument(
                f"logit_bias keys must be token ids >= 0, got {token!r}", param="logit_bias"
            )
        if token in pairs:
            raise InvalidArgument(f"logit_bias has token {token} twice", param="logit_bias")
        if not _number_in(value, -MAX_BIAS, MAX_BIAS):
            raise InvalidArgument(
                f"logit_bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {value!r} "
                f"for token {token}",
                param="logit_bias",
            )
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))
