"""The ingress deployment: the gRPC API (through Serve's gRPC proxy, and on the replica's own
direct endpoint, `router.direct`) and the OpenAI-compatible HTTP API (through Serve's HTTP
proxy), all calling one `Orchestrator` through the `GenerationService` interface
(router/generation_service.py), and the token stream server the workers send tokens to.

The direct endpoint serves `pdserve.v1.Generation` with the same methods as the proxy, on
`transfer.host`, at `router.grpc_port` (0: a free port), unless `router.direct_grpc` is off;
over TLS with `router.tls_cert_file`. With `router.api_keys`, every gRPC method and HTTP route
(but /health) first checks the caller's key (router/api_key_auth.py).
Why, and what Serve does not see of it: docs/architecture.md, "The channels around Serve"."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from fastapi import FastAPI
from ray import serve

from cluster.config import resolve_host
from cluster.errors import PdServeError, ResourceExhausted
from cluster.model.info import describe_model
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.serving.api_keys import ApiKeys
from cluster.serving.app_config import AppConfig
from cluster.serving.metrics import PoolMetrics
from cluster.serving.stats_registry import registry
from cluster.serving.vllm_metrics import served_model_name
from router.api_key_auth import ApiKeyAuth, check_call
from router.body_limit import BodyLimit, body_limit_bytes
from router.direct import Admission, GrpcServer, service_methods
from router.direct_tls import direct_tls
from router.endpoint_reporter import EndpointReporter
from router.grpc_api import generate_responses, model_info_to_proto, stats_to_proto
from router.openai_api import install_error_handlers, openai_routes
from router.openai_tokenize import tokenizer_routes
from router.orchestrator import Orchestrator
from router.token_stream import TokenStreamServer

log = logging.getLogger("ray.serve." + __name__)
GENERATION = pb.DESCRIPTOR.services_by_name["Generation"]
# How long streams on the router's direct endpoint may go on once the replica is stopping.
DIRECT_GRACE_S = 10.0


@serve.ingress()
class Router:
    async def __init__(self, config: AppConfig, prefill, decode, colocated) -> None:
        host = resolve_host(config.transfer.host)
        self.keys = ApiKeys(config.router.api_keys)
        tls = direct_tls(config.router.tls_cert_file, config.router.tls_key_file)  # fails early
        self.tokens = TokenStreamServer(host)
        await self.tokens.start()
        self.orch = Orchestrator(
            config,
            describe_model(config.model),
            prefill,
            decode,
            colocated,
            self.tokens,
            PoolMetrics("router", served_model_name(config.model)),
            app_name=serve.get_replica_context().app_name,
        )
        # Serve's limits for proxied calls, kept here for direct ones too (router/direct/).
        limits = config.router.ongoing_limit, config.router.queued_limit
        self.admission = Admission(*limits, refused=ResourceExhausted)
        self.direct: GrpcServer | None = None
        if config.router.direct_grpc:
            self.direct = GrpcServer(host, config.router.grpc_port, admission=self.admission)
            await self.direct.start(service_methods(GENERATION, self), ssl=tls)
        self.report = EndpointReporter(
            registry(config.name),
            str(serve.get_replica_context().replica_id.unique_id),
            self.grpc_endpoint(),
        )
        await self.report.start()

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="pdserve", version="1")
        app.include_router(openai_routes(lambda: self.orch))
        app.include_router(tokenizer_routes(lambda: self.orch))
        install_error_handlers(app)
        limit = body_limit_bytes(self.orch.prompts.max_prompt_bytes)
        app.add_middleware(BodyLimit, limit=limit)
        app.add_middleware(ApiKeyAuth, keys=self.keys)  # last added: runs first
        return app

    # -- gRPC: pdserve.v1.Generation -------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, grpc_context
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            check_call(self.keys, grpc_context)  # before a slot: a refused caller queues for none
            async with self.admission.slot(grpc_context):
                async with aclosing(generate_responses(request, self.orch)) as responses:
                    async for response in responses:
                        yield response
        except Exception as e:
            _fail(grpc_context, e)
            raise

    def grpc_endpoint(self) -> str:
        """Where this replica serves `pdserve.v1.Generation` itself, without Serve's proxy
        (`router.direct`), as "host:port"; "" with `router.direct_grpc` off. Clients
        find it in `GetStats` (router/endpoint_reporter.py)."""
        return self.direct.endpoint if self.direct is not None else ""

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context) -> pb.ModelInfo:
        try:
            check_call(self.keys, grpc_context)
        except Exception as e:
            _fail(grpc_context, e)
            raise
        return model_info_to_proto(self.orch.model)

    async def GetStats(self, request: pb.GetStatsRequest, grpc_context) -> pb.ClusterStats:
        try:
            check_call(self.keys, grpc_context)
            return stats_to_proto(await self.orch.stats())
        except Exception as e:
            _fail(grpc_context, e)
            raise

    async def __del__(self) -> None:
        report = getattr(self, "report", None)  # absent if __init__ failed early
        if report is not None:
            await report.stop()  # unlisted before its endpoint stops taking calls
        direct = getattr(self, "direct", None)
        if direct is not None:
            await direct.stop(DIRECT_GRACE_S)
        tokens = getattr(self, "tokens", None)
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
