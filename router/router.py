"""The ingress deployment: the gRPC API (through Serve's gRPC proxy) and the OpenAI-compatible
HTTP API (through Serve's HTTP proxy), both calling one `Orchestrator` through the
`GenerationService` interface (router/generation_service.py), and the token stream server the
workers send tokens to."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from fastapi import FastAPI
from ray import serve

from cluster.config import resolve_host
from cluster.errors import PdServeError
from cluster.model.info import describe_model
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.serving.app_config import AppConfig
from cluster.serving.metrics import PoolMetrics
from router.grpc_api import chunk_to_proto, model_info_to_proto, request_from_proto, stats_to_proto
from router.openai_api import install_error_handlers, openai_routes
from router.orchestrator import Orchestrator
from router.token_stream import TokenStreamServer

log = logging.getLogger(__name__)


@serve.ingress()
class Router:
    async def __init__(self, config: AppConfig, prefill, decode, colocated) -> None:
        self.tokens = TokenStreamServer(resolve_host(config.transfer.host))
        await self.tokens.start()
        self.orch = Orchestrator(
            config,
            describe_model(config.model),
            prefill,
            decode,
            colocated,
            self.tokens,
            PoolMetrics("router"),
            app_name=serve.get_replica_context().app_name,
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="pdserve", version="1")
        app.include_router(openai_routes(lambda: self.orch))
        install_error_handlers(app)
        return app

    # -- gRPC: pdserve.v1.Generation -------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, grpc_context
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            req = request_from_proto(request, self.orch)
            async with aclosing(self.orch.generate(req)) as chunks:
                async for chunk in chunks:
                    yield chunk_to_proto(chunk)
        except Exception as e:
            _fail(grpc_context, e)
            raise

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context) -> pb.ModelInfo:
        return model_info_to_proto(self.orch.model)

    async def GetStats(self, request: pb.GetStatsRequest, grpc_context) -> pb.ClusterStats:
        try:
            return stats_to_proto(await self.orch.stats())
        except Exception as e:
            _fail(grpc_context, e)
            raise

    async def __del__(self) -> None:
        tokens = getattr(self, "tokens", None)  # absent if __init__ failed early
        if tokens is not None:
            await tokens.stop()
        orch = getattr(self, "orch", None)
        if orch is not None:
            await orch.close()  # lets the lease releases on their way go out


def _fail(grpc_context, e: BaseException) -> None:
    """Put the documented status code on the call; anything unexpected is INTERNAL."""
    if isinstance(e, PdServeError):
        grpc_context.set_code(getattr(grpc.StatusCode, e.grpc_code))
        grpc_context.set_details(e.message)
    else:
        log.exception("internal error")
        grpc_context.set_code(grpc.StatusCode.INTERNAL)
        grpc_context.set_details(f"internal error: {type(e).__name__}")
