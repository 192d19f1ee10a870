"""Per-request sampling settings, validated once when the request is admitted."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.errors import InvalidArgument

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
# Bounds on stop conditions: every step checks each stop string against the new text, so an
# unbounded list is a per-token cost a single request could impose on its whole batch.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    """`temperature == 0` is greedy. `top_k == 0` turns top-k off. `seed` makes sampling
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
    # (under the model's own distribution, before temperature, top-k or top-p). None: off.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidArgument(
                f"max_tokens must be a positive integer, got {self.max_tokens}", param="max_tokens"
            )
        if math.isnan(self.temperature) or math.isinf(self.temperature) or self.temperature < 0:
            raise InvalidArgument(
                f"temperature must be a finite number >= 0, got {self.temperature}",
                param="temperature",
            )
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
