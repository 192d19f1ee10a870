"""`GrpcServer`: a gRPC server on the running asyncio loop for one table of methods, each
connection a `GrpcConnection` (grpc_connection.py), each call a `GrpcCall` (grpc_call.py).

The server knows no service of its own: its owner builds the method table, usually with
`service_methods` from a protobuf service descriptor and an object with a function per method
(the router passes `pdserve.v1.Generation` and itself, router/router.py). Every function is
called as `function(request, call)`, the call standing in for grpc's servicer context.
"""

from __future__ import annotations

import asyncio
from ssl import SSLContext
from typing import Any

from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from router.direct.admission import Admission
from router.direct.grpc_call import Method
from router.direct.grpc_connection import GrpcConnection
from router.direct.limits import DirectLimits


def service_methods(service: ServiceDescriptor, servicer: Any) -> dict[bytes, Method]:
    """`service`'s methods by path, served by `servicer`'s functions of the same names (one it
    lacks, or has as None, is UNIMPLEMENTED). Client-streaming methods are not served."""
    methods = {}
    for m in service.methods:
        if m.client_streaming:
            raise ValueError(f"{m.full_name} streams requests; only one request is taken")
        path = f"/{service.full_name}/{m.name}".encode()
        function = getattr(servicer, m.name, None)
        methods[path] = Method(GetMessageClass(m.input_type), m.server_streaming, function)
    return methods


class GrpcServer:
    """Serves one method table on `host:port` (0: a free port) until `stop`, within `limits`;
    with an `admission`, every call waits for one of its slots before it runs."""

    def __init__(
        self,
        host: str,
        port: int = 0,
        limits: DirectLimits | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.limits = limits or DirectLimits()
        self.admission = admission
        self.endpoint = ""
        self._listener: asyncio.Server | None = None
        self._connections: set[GrpcConnection] = set()

    async def start(self, methods: dict[bytes, Method], ssl: SSLContext | None = None) -> str:
        """Serve `methods` (by path, as `service_methods` makes them), over TLS with `ssl`
        (its ALPN must offer "h2"); returns "host:port"."""
        # No SO_REUSEPORT: a fixed port another process holds fails here, loudly, instead of
        # sharing its connections.
        self._listener = await asyncio.get_running_loop().create_server(
            lambda: GrpcConnection(methods, self._connections, self.limits, self.admission),
            self.host,
            self.port,
            reuse_port=False,
            ssl=ssl,
        )
        port = self._listener.sockets[0].getsockname()[1]  # asyncio sets TCP_NODELAY
        self.endpoint = f"{self.host}:{port}"
        return self.endpoint

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls (GOAWAY); let those under way finish for up to `grace_s`, then end
        them UNAVAILABLE (which closes their methods' streams and frees what they hold)."""
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
