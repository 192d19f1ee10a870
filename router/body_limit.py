"""`BodyLimit`: the OpenAI app's bound on a request body, checked before the body is parsed.

A body larger than the limit is answered 413 with OpenAI's error JSON
(`{"error": {"message", "type": "invalid_request_error", "param": null, "code":
"request_too_large"}}`): at once when its `Content-Length` says so, else as soon as the bytes
received pass it (a chunked body), so the router never holds more than the limit of one body.

The limit follows the model's context (`body_limit_bytes`): room for the largest prompt the
router would tokenize (`PromptTokenizer.max_prompt_bytes`) three times over, for JSON's escapes
(a three-byte character escaped as `\\uXXXX` is six), plus 1 MiB for everything else a body may
hold (stop strings, logit_bias, chat roles).
"""

from __future__ import annotations

import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_OTHER_BYTES = 1 << 20


def body_limit_bytes(max_prompt_bytes: int) -> int:
    return 3 * max_prompt_bytes + MAX_OTHER_BYTES


class BodyLimit:
    """ASGI middleware; `app.add_middleware(BodyLimit, limit=...)`."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # FastAPI answers it (router/openai_api.py)
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, bounded, send)

    def _message(self) -> str:
        return f"request body larger than the limit of {self.limit} bytes"

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": self._message(),
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
