"""vLLM's and Ray Serve LLM's tokenizer endpoints beside the OpenAI API: `POST /tokenize`
(a prompt, or chat messages rendered as `/v1/chat/completions` renders them), `POST
/detokenize`, and `GET /v1/models/{id}`. The same bounds as a generation's prompt apply."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from cluster.errors import InvalidArgument, NotFound
from router.generation_service import GenerationService
from router.openai_protocol import ChatMessage, ModelCard


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None


class TokenizeRequest(_Body):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Body):
    tokens: list[int] = Field(max_length=1 << 20)


def tokenizer_routes(get_service: Callable[[], GenerationService]) -> APIRouter:
    router = APIRouter()
    started = int(time.time())

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        service = get_service()
        _check_model(service, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidArgument("give either prompt or messages", param="prompt")
        if body.prompt is not None:
            ids = await service.tokenize(body.prompt)
        else:
            template = service.chat_options.template_call(
                body.chat_template_kwargs, body.add_generation_prompt, body.continue_final_message
            )
            messages = [m.for_template() for m in body.messages or []]
            ids = await service.chat_prompt(messages, body.tools, template)
        limit = service.model.max_context_length
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": limit})

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        service = get_service()
        _check_model(service, body.model)
        vocab = service.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"token ids out of vocabulary [0, {vocab}): {bad[:5]}", "tokens")
        return JSONResponse({"prompt": service.detokenize(body.tokens)})

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        served = get_service().model
        _check_model(get_service(), model_id)
        card = ModelCard(
            id=served.name,
            created=started,
            max_model_len=served.max_context_length,
            sampling_defaults=dict(served.sampling_defaults) or None,
        )
        return JSONResponse(card.model_dump(exclude_none=True))

    return router


def _check_model(service: GenerationService, requested: str | None) -> None:
    if requested and requested not in service.model.names:
        raise NotFound(f"model {requested!r} is not served here", param="model")
