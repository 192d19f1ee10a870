"""The router replica's own gRPC endpoint: `pdserve.v1.Generation`, the same service and code as
through Serve's gRPC proxy, served by the router itself on `transfer.host`, at
`router.grpc_port` (0: a free port), unless `router.direct_grpc` is off. Each replica lists it
in `GetStats` (router/endpoint_reporter.py); `GenerationClient.direct` and `pdserve generate /
bench --direct` use it (docs/api.md).

Why: every message through Serve's proxy costs CPU of its own in the proxy and in Serve's
wrappers around the router (pickled with its gRPC context, a thread hop and back in the proxy).
Clients need no change beyond the address; Serve's proxy keeps serving the same API on its
port. The endpoint speaks gRPC over HTTP/2 itself (router/grpc_connection.py, one
`GrpcCall` per call, router/grpc_call.py) rather than through grpc.aio, to write each loop
turn's messages for a connection at once (grpc.aio writes each one on its own).

What Serve does not see here: the router deployment's own `max_ongoing_requests` and queue
limit, and its autoscaling signal, count proxied requests only. The pools behind the router are
reached through their Serve handles either way, so their limits, queues and autoscaling apply,
and a full pool refuses a request with RESOURCE_EXHAUSTED on both paths.
"""

from __future__ import annotations

import asyncio
from typing import Any

from google.protobuf.message_factory import GetMessageClass

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from router.grpc_call import Method
from router.grpc_connection import GrpcConnection


def generation_methods(servicer: Any) -> dict[bytes, Method]:
    """`pdserve.v1.Generation`'s methods by path, from its descriptor, served by `servicer`'s
    functions of the same names (one it lacks, or has as None, is UNIMPLEMENTED)."""
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    methods = {}
    for m in service.methods:
        assert not m.client_streaming, "every request here is one message"
        path = f"/{service.full_name}/{m.name}".encode()
        function = getattr(servicer, m.name, None)
        methods[path] = Method(GetMessageClass(m.input_type), m.server_streaming, function)
    return methods


class GrpcEndpoint:
    """A gRPC server for one servicer of `pdserve.v1.Generation`, on the running loop."""

    def __init__(self, host: str, port: int = 0) -> None:
        self.host = host
        self.port = port
        self.endpoint = ""
        self._listener: asyncio.Server | None = None
        self._connections: set[GrpcConnection] = set()

    async def start(self, servicer: Any) -> str:
        """Serve `servicer`; returns "host:port"."""
        methods = generation_methods(servicer)
        # No SO_REUSEPORT: a fixed port another process holds fails here, loudly, instead of
        # sharing its connections (router replicas never share one: RouterConfig).
        self._listener = await asyncio.get_running_loop().create_server(
            lambda: GrpcConnection(methods, self._connections),
            self.host,
            self.port,
            reuse_port=False,
        )
        port = self._listener.sockets[0].getsockname()[1]  # asyncio sets TCP_NODELAY
        self.endpoint = f"{self.host}:{port}"
        return self.endpoint

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls (GOAWAY); let those under way finish for up to `grace_s`, then end
        them UNAVAILABLE (which closes their streams and frees what they hold)."""
        if self._listener is None:
            return
        self._listener.close()
        self._listener = None
        for conn in self._connections:
            conn.go_away()
        tasks = [c.task for conn in self._connections for c in conn.calls.values() if c.task]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for conn in list(self._connections):
            for call in list(conn.calls.values()):
                call.cancel(stopping=True)
        if tasks:
            await asyncio.wait(tasks)
        for conn in list(self._connections):
            conn.close()
