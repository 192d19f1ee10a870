"""The router's API key check at both of its doors, over one `ApiKeys`
(cluster/serving/api_keys.py):

- gRPC (`check_call`): the `pdserve.v1.Generation` handlers of `Router` (router/router.py)
  call it first, on Serve's gRPC proxy (the context is Serve's `RayServegRPCContext`, which
  carries the client's metadata) and on the direct endpoint (the context is the call,
  `router.direct.GrpcCall`, which carries the request headers). A refused call raises
  `Unauthenticated` before anything is read or started: UNAUTHENTICATED.
- HTTP (`ApiKeyAuth`, ASGI middleware, outermost): every route but `OPEN_PATHS` answers 401
  with OpenAI's error JSON (`code: invalid_api_key`) and `WWW-Authenticate: Bearer` before the
  body is read. Serve's own probes (`/-/healthz`, `/-/routes`) are answered by the proxy and
  never reach the router.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from cluster.errors import Unauthenticated
from cluster.serving.api_keys import ApiKeys

# Routes open without a key: a load balancer's liveness probe, which says nothing of the model.
OPEN_PATHS = frozenset({"/health"})


def authorization(context: Any) -> str | bytes | None:
    """The `authorization` metadata of a gRPC call: grpc's (and Serve's) servicer contexts list
    it in `invocation_metadata()`, the direct endpoint's call holds its request `headers`."""
    metadata = getattr(context, "invocation_metadata", None)
    if metadata is not None:
        for key, value in metadata() or ():
            if key == "authorization":
                return value
        return None
    return getattr(context, "headers", {}).get(b"authorization")


def check_call(keys: ApiKeys, context: Any) -> None:
    """Raise `Unauthenticated` unless the call carries one of `keys` (always passes without)."""
    if keys.required:
        keys.check(authorization(context))


class ApiKeyAuth:
    """ASGI middleware; `app.add_middleware(ApiKeyAuth, keys=...)` last, so it runs first."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.required or _route(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                header = value
                break
        try:
            self.keys.check(header)
        except Unauthenticated as e:
            await _refuse(send, e)
            return
        await self.app(scope, receive, send)


def _route(scope: Scope) -> str:
    """The path within the app: Serve mounts it under its route prefix (`root_path`), which
    the ASGI path includes."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _refuse(send: Send, e: Unauthenticated) -> None:
    error = {"message": e.message, "type": e.error_type, "param": None, "code": "invalid_api_key"}
    body = json.dumps({"error": error}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": e.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
