"""What the router streams to its API layers (gRPC and OpenAI HTTP) for one request."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.request import TokenLogprobs


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class Timing:
    """Where the request's time went, in seconds, as the router saw it."""

    queue_seconds: float
    prefill_seconds: float
    kv_transfer_seconds: float
    time_to_first_token_seconds: float
    decode_seconds: float
    total_seconds: float
    prefill_replica: str
    decode_replica: str
    migrations: int = 0  # times the generation resumed on another replica mid-stream


@dataclass(slots=True)
class GenerationChunk:
    """New tokens and their text. The last chunk has `finish_reason` ("stop", "length" or
    "abort"), `usage` and `timing`; earlier ones have None there. A value, not declared frozen
    for the reason `StepOutput` gives (one per relayed message)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when the request asked

    def scored(self) -> list[tuple[int, TokenLogprobs]]:
        """(token id, its logprobs) pairs; empty when the request asked for no logprobs."""
        return list(zip(self.token_ids, self.logprobs, strict=False))
