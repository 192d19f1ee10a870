"""What a caller hands the engine, and what the engine hands back per step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from cluster.errors import InvalidArgument, PdServeError
from cluster.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "prefilled"]
MAX_STREAM_INTERVAL = 4096  # tokens per streamed message, at most
# A client's request id is a label: at most this many printable ASCII characters (the token
# frames between workers and routers carry ids of up to 256).
MAX_REQUEST_ID_BYTES = 256


def check_request_id(request_id: str) -> None:
    """Refuse, naming `request_id`, an id longer than `MAX_REQUEST_ID_BYTES` or with a
    character outside printable ASCII (space to `~`)."""
    if len(request_id) > MAX_REQUEST_ID_BYTES:
        raise InvalidArgument(
            f"request_id must be at most {MAX_REQUEST_ID_BYTES} characters, got {len(request_id)}",
            param="request_id",
        )
    if not all(" " <= c <= "~" for c in request_id):
        raise InvalidArgument(
            "request_id must be printable ASCII (space to '~')", param="request_id"
        )


@dataclass(frozen=True)
class Request:
    """One generation. `prefill_only` makes the engine stop after the first sampled token and
    keep the prompt's KV blocks pinned for export (the prefill pool's mode of work).

    `output_token_ids`: tokens this generation already produced, and the client already has,
    before it resumed on this engine (decode migration). Their KV is computed like the prompt's,
    but they count as output: for `max_tokens`, the sampling positions, penalties and stop
    strings, so the generation goes on exactly as if it had never moved.

    `stream_interval`: after the first, a worker sends this request's tokens to the router
    every `stream_interval` tokens (and with the last), merged into one message: fewer,
    larger messages on every hop for a client that needs no token-by-token stream (vLLM's
    `--stream-interval`).

    `request_id` addresses the request's state everywhere (engine, lease, cancel, token
    stream): the router makes a random one for every attempt (first try, retry, migration), so
    no client can name, cancel or collide with another's work. `label` is the client's own
    name for the request (its `request_id`): echoed back and logged, never used to address
    anything."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    prefill_only: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: tuple[int, ...] = ()
    stream_interval: int = 1
    label: str = ""

    @property
    def name(self) -> str:
        """What the client calls it: its label, else the id."""
        return self.label or self.request_id

    @property
    def num_context_tokens(self) -> int:
        """Tokens whose KV precedes the first token this engine samples."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely tokens at its position."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(slots=True)
class StepOutput:
    """The tokens one request gained in one engine step. `text` is the new, stop-string-safe
    text; `finish_reason` is set on the request's last output only ("prefilled" means the KV is
    held for export and decoding continues elsewhere). `error`: the request failed alone (its
    sampling, detokenization or stop check raised; finish reason "abort", no tokens); whoever
    delivers the output fails the request's stream with it instead.

    A value: nothing changes one after it is built (changes go through `dataclasses.replace`).
    Not declared frozen because one is built per sequence per engine step and again per item
    the router relays, and a frozen dataclass takes several times as long to build (its
    `object.__setattr__` per field)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    queue_seconds: float = 0.0  # on a sequence's first sampled output: arrival to first step
    num_cached_tokens: int = 0  # on the first sampled output: prompt tokens the cache supplied
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when the request asked
    error: PdServeError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A whole generation, gathered from its step outputs (used by `Engine.generate`)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: PdServeError | None = None  # why the engine failed the request, if it did

    def add(self, out: StepOutput) -> None:
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.text += out.text
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.error = out.error
