"""The router replica's own gRPC endpoint: `pdserve.v1.Generation`, the same service and code as
through Serve's gRPC proxy, served by the router itself on `transfer.host`, at
`router.grpc_port` (0: a free port), unless `router.direct_grpc` is off. Each replica lists it
in `GetStats` (router/endpoint_reporter.py); `GenerationClient.direct` and `pdserve generate /
bench --direct` use it (docs/api.md).

Why: every message through Serve's proxy costs CPU of its own in the proxy and in Serve's
wrappers around the router (pickled with its gRPC context, a thread hop and back in the proxy):
measured with `benchmarks/capacity_bench.py` at 64 streams, about 200 µs of proxy CPU and
165 µs of router CPU per message, against about 115 µs of router CPU per message here. Clients
need no change beyond the address; Serve's proxy keeps serving the same API on its port.

What Serve does not see here: the router deployment's own `max_ongoing_requests` and queue
limit, and its autoscaling signal, count proxied requests only. The pools behind the router are
reached through their Serve handles either way, so their limits, queues and autoscaling apply,
and a full pool refuses a request with RESOURCE_EXHAUSTED on both paths.
"""

from __future__ import annotations

from typing import Any

import grpc

from router.grpc_ingress import add_generation_servicer


class GrpcEndpoint:
    """A grpc.aio server for one servicer of `pdserve.v1.Generation`, on the running loop."""

    def __init__(self, host: str, port: int = 0) -> None:
        self.host = host
        self.port = port
        self.endpoint = ""
        self._server: grpc.aio.Server | None = None

    async def start(self, servicer: Any) -> str:
        """Serve `servicer`; returns "host:port"."""
        # No SO_REUSEPORT: a fixed port another process holds fails here, loudly, instead of
        # sharing its connections (router replicas never share one: RouterConfig).
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        add_generation_servicer(servicer, self._server)
        port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        await self._server.start()
        self.endpoint = f"{self.host}:{port}"
        return self.endpoint

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls; let those under way finish for up to `grace_s`, then cancel them
        (which frees what they hold)."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
