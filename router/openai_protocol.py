"""The OpenAI-compatible HTTP payloads: request bodies in, response objects and stream chunks out.

Requests ignore fields they do not know (the official client sends some); fields pdserve knows
but cannot honour (`n` above `MAX_CHOICES`, more than `MAX_PROMPTS` prompts, `echo`, and
those router/openai_unsupported.py lists: `best_of`, ...) are refused with a 400 that names
them, never silently dropped. Responses follow OpenAI's shapes; the extra `pdserve_timing`
object on the last response or chunk carries the phase timings.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.fan_out import MAX_CHOICES, MAX_PROMPTS
from router.generation_chunk import Timing, Usage
from router.openai_structured import StructuredFields
from router.openai_unsupported import UnsupportedChatFields, UnsupportedCompletionFields


def _omit_if_none(value: object) -> bool:
    return value is None


def _omitted_when_none(default: Any = None) -> Any:
    """A field left out of the JSON when None (OpenAI omits, e.g., `delta.role` after the first)."""
    return Field(default=default, exclude_if=_omit_if_none)


# -- requests ----------------------------------------------------------------------------------


MAX_TOKEN_ID_DIGITS = 10  # token ids are below 2**31


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    """`include_usage`: one last chunk with the request's usage. `continuous_usage_stats` (vLLM's,
    and as there only with `include_usage`): every chunk carries its choice's usage so far."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingBody(_Body, StructuredFields):
    """Fields the two endpoints share: model choice, streaming, and sampling."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias
    # vLLM-style extras.
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int) -> int:
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"must be in 1..{MAX_CHOICES}, got {n}")
        return n

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        # A key longer than any token id is refused before `int` reads it (past 4,300 digits
        # `int` raises, and reading a long one costs time).
        bad = [
            k[:12] + "..." if len(k) > 12 else k
            for k in bias or {}
            if not k.isascii() or not k.isdigit() or len(k) > MAX_TOKEN_ID_DIGITS
        ]
        if bad:
            raise ValueError(f"keys must be token ids (integers in [0, 2**31)), got {bad[:5]}")
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: `continuous_usage_stats`, which (as in vLLM) needs
        `include_usage`."""
        return self.include_usage and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]

    @property
    def logprobs_count(self) -> int | None:
        """Alternatives per token the request wants (None: no logprobs at all)."""
        return None

    def sampling_fields(self, max_tokens: int | None) -> dict[str, Any]:
        """Keyword arguments for `GenerationService.sampling_params` (None = server default)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return dict(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            # vLLM clients send top_k=-1 for "off"; pdserve spells off as 0.
            top_k=0 if self.top_k == -1 else self.top_k,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs_count,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            min_p=self.min_p,
            structured=self.constraint(),
        )


class CompletionRequest(_SamplingBody, UnsupportedCompletionFields):
    """`POST /v1/completions`. A prompt (text or token ids), or a list of up to `MAX_PROMPTS`
    of them, each answered with `n` choices."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's default; an explicit null takes the server default.
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _bounded_batch(cls, prompt: Any) -> Any:
        if len(_batch(prompt)) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts a request, got {len(prompt)}")
        return prompt

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    def prompt_inputs(self) -> list[tuple[str | None, list[int] | None]]:
        """(text, token ids) of each prompt, for `GenerationService.build_request`; exactly one
        of the two is set."""
        return [(p, None) if isinstance(p, str) else (None, list(p)) for p in _batch(self.prompt)]


def _batch(prompt: Any) -> list[Any]:
    """A completion's prompts: a list of texts or of token-id lists, else the one prompt."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt
    return [prompt]


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"only text content parts are supported, got {part.type!r}")
        return content

    def for_template(self) -> dict[str, str]:
        """The message as chat templates expect it: role and plain-text content."""
        if isinstance(self.content, list):
            text = "\n".join(part.text or "" for part in self.content)
        else:
            text = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier call as chat templates read it: arguments as an object, not JSON text."""
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            raise ValueError("a tool call's arguments must be JSON") from None
    return {**call, "function": fn}


class ChatCompletionRequest(_SamplingBody, UnsupportedChatFields):
    """`POST /v1/chat/completions`. Without a token limit the server default applies."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        """`max_completion_tokens` supersedes the deprecated `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# -- responses ---------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None

    @classmethod
    def of(cls, usage: Usage) -> UsageInfo:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details={"cached_tokens": usage.cached_prompt_tokens},
        )


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and also the shape of each streamed completion chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _omitted_when_none()
    pdserve_timing: Timing | None = _omitted_when_none()


class FunctionCall(BaseModel):
    name: str | None = _omitted_when_none()
    arguments: str | None = _omitted_when_none()


class ToolCallOut(BaseModel):
    """A call in a response; in a stream chunk `index` is set and the rest only once."""

    index: int | None = _omitted_when_none()
    id: str | None = _omitted_when_none()
    type: Literal["function"] | None = _omitted_when_none()
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = _omitted_when_none()
    tool_calls: list[ToolCallOut] | None = _omitted_when_none()


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    pdserve_timing: Timing | None = _omitted_when_none()


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = _omitted_when_none()
    content: str | None = _omitted_when_none()
    reasoning_content: str | None = _omitted_when_none()
    tool_calls: list[ToolCallOut] | None = _omitted_when_none()


class ChatCompletionChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = _omitted_when_none()
    pdserve_timing: Timing | None = _omitted_when_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int
    sampling_defaults: dict[str, float] | None = _omitted_when_none()  # --generation-config


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
