"""The OpenAI-compatible HTTP API: routes over a `GenerationService` (router/generation_service.py),
and OpenAI-shaped errors.

Independent of Ray: the Serve ingress mounts `openai_routes(get_service)` and calls
`install_error_handlers(app)`; tests do the same with a service double.

A request's path here: validate the body → resolve the model → `sampling_params` and
`build_request` (hop 1) → `generate` and await its first chunk → answer. Awaiting the first chunk
before answering means a refused request (429, 503, ...) gets its own status, not a 200 stream.
After that, an error in a stream is sent as a last `data: {"error": ...}` event before
`data: [DONE]`.

Finish reasons: "stop" and "length" pass through. OpenAI has no "abort" (the server gave up on
the request, e.g. a replica shutting down): it is reported as a 503 `service_unavailable`
error, retryable, rather than as a truncated answer that claims to be complete.

Whoever opens the service's generator closes it, on every exit: finished, failed, or the
client went away mid-stream. Closing it aborts the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from cluster.errors import InvalidArgument, NotFound, PdServeError, Unavailable
from router.chat.chat_plan import ChatPlan
from router.fan_out import choice_requests, fan_out, total_usage
from router.generation_chunk import GenerationChunk, Usage
from router.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
)
from router.openai_views import ChatView, CompletionView, Scored, merged

if TYPE_CHECKING:
    from cluster.request import Request as GenerationRequest
    from router.generation_service import GenerationService

logger = logging.getLogger("ray.serve." + __name__)


class ModelNotFound(NotFound):
    code = "model_not_found"


def openai_routes(get_service: Callable[[], GenerationService]) -> APIRouter:
    """`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`.
    `get_service` is called per request and returns the live service."""
    router = APIRouter()
    started = int(time.time())

    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/v1/models", response_model=ModelList)
    async def models() -> Response:
        model = get_service().model
        card = ModelCard(
            id=model.name,
            created=started,
            max_model_len=model.max_context_length,
            sampling_defaults=dict(model.sampling_defaults) or None,
        )
        return _json(ModelList(data=[card]))

    @router.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest) -> Response:
        service = get_service()
        model = _served_model(service, body.model)
        params = service.sampling_params(**body.sampling_fields(body.max_tokens))
        params.check_vocab(service.model.vocab_size)
        prompts = [await service.build_request(*p, params) for p in body.prompt_inputs()]
        id, created = f"cmpl-{prompts[0].request_id}", int(time.time())
        choices = range(len(prompts) * body.n)  # prompt i's choice j is i * n + j, as vLLM's
        views = [CompletionView(id, created, model, service.token_text, i) for i in choices]
        return await _answer(service, prompts, views, body)

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        service = get_service()
        model = _served_model(service, body.model)
        plan = ChatPlan(service.chat_options, body.tools, body.tool_choice)
        fields = body.sampling_fields(body.token_limit)
        if plan.constraint is not None:
            if fields["structured"] is not None:
                raise InvalidArgument(
                    "tool_choice required or named constrains the answer already; "
                    "leave out response_format",
                    param="tool_choice",
                )
            fields["structured"] = plan.constraint
        params = service.sampling_params(**fields)
        params.check_vocab(service.model.vocab_size)
        messages = [m.for_template() for m in body.messages]
        template = service.chat_options.template_call(
            body.chat_template_kwargs, body.add_generation_prompt, body.continue_final_message
        )
        prompt_token_ids = await service.chat_prompt(messages, plan.tools or None, template)
        request = await service.build_request(None, prompt_token_ids, params)
        id, created = f"chatcmpl-{request.request_id}", int(time.time())
        views = [ChatView(id, created, model, service.token_text, plan, i) for i in range(body.n)]
        return await _answer(service, [request], views, body)

    return router


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error as OpenAI does: `{"error": {message, type, param, code}}`. Validation
    errors are 400 (not FastAPI's 422); anything unexpected is a 500 without its traceback."""
    app.add_exception_handler(PdServeError, _pdserve_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


# -- one request -------------------------------------------------------------------------------


def _served_model(service: GenerationService, requested: str | None) -> str:
    """The served model's public name; `requested` may be empty, that name, or the model id."""
    names = service.model.names
    if requested and requested not in names:
        raise ModelNotFound(
            f"model {requested!r} is not served here; this server serves {names[0]!r}",
            param="model",
        )
    return names[0]


async def _answer(
    service: GenerationService,
    prompts: Sequence[GenerationRequest],
    views: Sequence[CompletionView | ChatView],
    body: CompletionRequest | ChatCompletionRequest,
) -> Response:
    """Generate each prompt's `n` choices (router/fan_out.py, one view each) and answer: a
    stream of events, or one response with every choice and the request's usage."""
    requests = [c for prompt in prompts for c in choice_requests(prompt, body.n)]
    chunks = fan_out(service.generate, requests, body.n)
    try:
        first = await _next(chunks)
    except BaseException:
        await _close(chunks)
        raise
    if body.stream:
        prompt_tokens = tuple(len(r.prompt_token_ids) for r in requests)
        usage = _Usage(prompt_tokens, body.n, body.include_usage, body.continuous_usage)
        return _EventStream(_events(chunks, first, views, usage))
    texts: list[list[str]] = [[] for _ in views]
    scored: list[Scored] = [[] for _ in views]
    lasts: list[GenerationChunk] = [first[1]] * len(views)
    try:
        async for i, chunk in _relay(chunks, first):
            texts[i].append(chunk.text)
            scored[i].extend(chunk.scored())
            lasts[i] = chunk
    finally:
        await _close(chunks)
    parts = zip(views, texts, lasts, scored, strict=True)
    responses = [view.response("".join(t), last, s) for view, t, last, s in parts]
    return _json(merged(responses, total_usage([_usage(c) for c in lasts], body.n)))


Choice = tuple[int, GenerationChunk]  # (choice index, chunk), as `fan_out` yields them


async def _relay(chunks: AsyncIterator[Choice], first: Choice) -> AsyncIterator[Choice]:
    """`first`, then the rest, up to every choice's chunk with the finish reason."""
    item = first
    while True:
        if item[1].finish_reason == "abort":
            raise Unavailable("the server aborted the request before it finished; retry it")
        yield item
        try:
            item = await _next(chunks)
        except StopAsyncIteration:
            return


def _usage(last: GenerationChunk) -> Usage:
    if last.usage is None:
        raise PdServeError("generation ended without its usage")
    return last.usage


async def _next(chunks: AsyncIterator[Choice]) -> Choice:
    """`anext(chunks)` in a task of its own, so that a cancellation of this request (the client
    left) reaches the generation exactly once. Starlette cancels through anyio, which fails every
    later await in the cancelled scope, and the generation's cleanup must await to abort the
    request on its workers and free its KV."""
    step = asyncio.ensure_future(anext(chunks))
    try:
        return await asyncio.shield(step)
    except asyncio.CancelledError:
        step.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait([step])
        raise


@dataclass(frozen=True)
class _Usage:
    """What a stream says of usage: each choice's `prompt_tokens`, the choices a prompt (`n`),
    and the request's `stream_options`."""

    prompt_tokens: tuple[int, ...]
    n: int
    at_end: bool  # include_usage: a last chunk with the request's usage
    on_every_chunk: bool  # continuous_usage_stats: each chunk its choice's usage so far


async def _events(
    chunks: AsyncIterator[Choice],
    first: Choice,
    views: Sequence[CompletionView | ChatView],
    usage: _Usage,
) -> AsyncIterator[str]:
    """Server-sent events for a started generation, ending in `data: [DONE]`."""
    generated = [0] * len(views)  # tokens per choice so far
    lasts: list[Usage | None] = [None] * len(views)
    try:
        try:
            async for i, chunk in _relay(chunks, first):
                is_first = lasts[i] is None and generated[i] == 0
                generated[i] += len(chunk.token_ids)
                for payload in views[i].chunks(chunk, is_first=is_first):
                    if usage.on_every_chunk:
                        so_far = chunk.usage or Usage(usage.prompt_tokens[i], generated[i])
                        payload.usage = UsageInfo.of(so_far)
                    yield _event(payload)
                if chunk.finish_reason is not None:
                    lasts[i] = _usage(chunk)
            if usage.at_end:
                total = total_usage(lasts, usage.n)  # type: ignore[arg-type]
                yield _event(views[0].usage_chunk(total))
        except PdServeError as e:
            yield _event(_error_response(e))
        except Exception:
            logger.exception("stream of %s failed", views[0].id)
            yield _event(_error_response(PdServeError("internal error")))
        yield "data: [DONE]\n\n"
    finally:
        await _close(chunks)


async def _close(chunks: AsyncIterator[Choice]) -> None:
    # Shielded: this often runs because the request was cancelled (the client left), and the
    # close must still reach the workers. A no-op if `_next` already ended the generation.
    with anyio.CancelScope(shield=True):
        await chunks.aclose()  # type: ignore[attr-defined]


class _EventStream(StreamingResponse):
    """An SSE response that closes its events (and so the generation) however it ends: done,
    client disconnect reported by cancellation (ASGI < 2.4) or by a failed send (ASGI 2.4)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()  # type: ignore[attr-defined]


def _json(
    model: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(model.model_dump_json(), status_code, headers, "application/json")


def _event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


# -- errors ------------------------------------------------------------------------------------


def _error_response(e: PdServeError) -> ErrorResponse:
    code = getattr(e, "code", None) or e.grpc_code.lower()
    return ErrorResponse(
        error=ErrorInfo(message=e.message, type=e.error_type, param=e.param, code=code)
    )


async def _pdserve_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, PdServeError)
    return _json(_error_response(e), e.http_status)


async def _validation_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, RequestValidationError)
    message, param = _describe(e.errors())
    error = ErrorInfo(
        message=message, type="invalid_request_error", param=param, code="invalid_argument"
    )
    return _json(ErrorResponse(error=error), 400)


# Pydantic names the alternatives of a union in an error's location ("prompt", "list[int]", 0).
_UNION_MEMBER = re.compile(r"(str|int|float|bool|none|list|dict|function-[a-z-]+)(\[.*\])?")


def _describe(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One readable message, and the first offending field, from pydantic's errors; a value that
    fits none of a union's alternatives is reported once, as the types it may take."""
    problems: dict[str, list[tuple[str | None, str]]] = {}
    for err in errors:
        if err.get("type") == "json_invalid":
            problems.setdefault("body", []).append((None, f"invalid JSON: {err.get('msg')}"))
            continue
        field, member = [], None
        for part in map(str, err.get("loc", ())[1:]):  # [0] is "body"
            if _UNION_MEMBER.fullmatch(part):
                member = part
                break
            field.append(part)
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        problems.setdefault(".".join(field) or "body", []).append((member, msg))
    lines = []
    for field, found in problems.items():
        members = list(dict.fromkeys(m for m, _ in found if m is not None))
        if len(members) > 1:
            lines.append(f"{field}: expected {' or '.join(members)}")
        else:
            lines.extend(f"{field}: {msg}" for msg in dict.fromkeys(msg for _, msg in found))
    param = next(iter(problems), None)
    return "; ".join(lines) or "invalid request body", None if param == "body" else param


async def _http_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, StarletteHTTPException)
    if e.status_code == 404:
        kind = "not_found_error"
    elif e.status_code < 500:
        kind = "invalid_request_error"
    else:
        kind = "internal_error"
    code = "request_too_large" if e.status_code == 413 else None  # as router/body_limit.py
    error = ErrorInfo(message=str(e.detail), type=kind, code=code)
    return _json(ErrorResponse(error=error), e.status_code, e.headers)


async def _unexpected_error(request: Request, e: Exception) -> Response:
    # Starlette logs the exception with its traceback; the client sees none of it.
    error = ErrorInfo(message="internal server error", type="internal_error", code="internal")
    return _json(ErrorResponse(error=error), 500)
