"""The processes of `router_path_bench` (spawned; each puts where it listens on `ready`): a bare
servicer on grpc.aio or on the router's own endpoint, the worker double that streams tokens to
a router's token server, and the router's own code with or without its gRPC endpoint; and how
a stream's messages are read and checked, by them and by the bench's client."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from benchmarks.stream_load import run_loop

FIRST_TOKEN = 100  # stream token i is FIRST_TOKEN + i


def grpc_alone(ready, step_s: float, own_endpoint: bool) -> None:
    """A bare `Generate` servicer whose streams all wake from one event per step, served by
    grpc.aio or (`own_endpoint`) by the router's `GrpcServer` (router.direct)."""
    import grpc

    from cluster.pb.pdserve.v1 import generation_pb2 as pb
    from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc

    class Servicer(pb_grpc.GenerationServicer):
        def __init__(self) -> None:
            self.step = asyncio.Event()

        async def Generate(self, request, context):
            for i in range(request.sampling.max_tokens):
                await self.step.wait()
                yield pb.GenerateResponse(
                    request_id=request.request_id, token_ids=[FIRST_TOKEN + i], text=f"<{i}>"
                )

    async def main() -> None:
        from router.direct import GrpcServer, service_methods

        servicer = Servicer()
        if own_endpoint:
            server = GrpcServer("127.0.0.1")
            service = pb.DESCRIPTOR.services_by_name["Generation"]
            ready.put(await server.start(service_methods(service, servicer)))
        else:
            server = grpc.aio.server()
            pb_grpc.add_GenerationServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            ready.put(f"127.0.0.1:{port}")
        while True:
            servicer.step.set()
            servicer.step.clear()
            await asyncio.sleep(step_s)

    run_loop(main())


def worker_double(ready, step_s: float) -> None:
    """Streams for the router: told (request id, endpoint, key, tokens) per line on a control
    socket, it sends one output per stream per step, each step's as one frame, and answers
    the request id on the control socket once a stream's last output went out (a Serve call
    to a worker returns then)."""
    from cluster.request import StepOutput
    from cluster.serving.pool_messages import TokenRoute, WorkerChunk
    from decode_worker.token_sender import TokenSender

    async def main() -> None:
        sender = TokenSender()
        streams: dict[str, list] = {}  # request id -> [sink, next index, tokens, control]

        async def control(reader, writer) -> None:
            while line := await reader.readline():
                rid, endpoint, key, tokens = line.decode().split()
                route = TokenRoute(endpoint, bytes.fromhex(key))
                sink = await sender.open(route, rid, lambda out, first: WorkerChunk(out, "w0"))
                streams[rid] = [sink, 0, int(tokens), writer]

        server = await asyncio.start_server(control, "127.0.0.1", 0)
        ready.put(server.sockets[0].getsockname()[1])
        while True:
            await asyncio.sleep(step_s)
            conns = set()
            for rid, stream in list(streams.items()):
                sink, i, n, writer = stream
                finish = "length" if i == n - 1 else None
                out = StepOutput(rid, (FIRST_TOKEN + i,), f"<{i}>", finish, 3, i + 1)
                if (conn := sink.put(out)) is not None:
                    conns.add(conn)
                stream[1] += 1
                if finish is not None:
                    del streams[rid]
                    writer.write(f"{rid}\n".encode())
            for conn in conns:
                conn.flush()

    run_loop(main())


class WorkerLink:
    """The router's Serve calls to the worker double: `start` sends the stream's line and
    returns a `Call` that lasts until the double reports the stream's last output sent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.calls: dict[str, Call] = {}
        self.returns = asyncio.ensure_future(self._returns(reader))
        self.remote = self.start  # as `handle.generate.remote`

    def start(self, request, route) -> Call:
        key, n = route.key.hex(), request.params.max_tokens
        self.writer.write(f"{request.request_id} {route.endpoint} {key} {n}\n".encode())
        self.calls[request.request_id] = Call()
        return self.calls[request.request_id]

    async def _returns(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            call = self.calls.pop(line.decode().strip(), None)
            if call is not None and not call.done.done():
                call.done.set_result(None)


class Call:
    """Stands for the Serve call to the worker: it lasts as long as the stream."""

    def __init__(self) -> None:
        self.done = asyncio.get_running_loop().create_future()

    def __await__(self):
        return self.done.__await__()

    def cancel(self) -> None:
        self.done.cancel()


def router_code(ready, worker_port: int, checkpoint: str, with_grpc: bool) -> None:
    """The router's path in a plain process; the worker call is a line to the worker double."""
    from router.grpc_api import generate_responses

    async def main() -> None:
        orch = await router_path(worker_port, checkpoint)
        if with_grpc:
            server = await serve_router_path(orch)
            ready.put(server.endpoint)
            await asyncio.Event().wait()

        async def local(reader, writer) -> None:  # "N T" -> `summary` of N streams
            while line := await reader.readline():
                n, t = map(int, line.split())
                results = await asyncio.gather(
                    *[read_generated(generate_responses(request(t), orch)) for _ in range(n)]
                )
                writer.write(summary(results, t).encode() + b"\n")

        server = await asyncio.start_server(local, "127.0.0.1", 0)
        ready.put(f"local:{server.sockets[0].getsockname()[1]}")
        await asyncio.Event().wait()

    run_loop(main())


async def router_path(worker_port: int, checkpoint: str, metrics=None):
    """The router's own code for a stream, on the running loop: its token stream server and an
    `Orchestrator` in colocated mode whose worker calls go to the worker double at
    `worker_port`; `metrics`: the router's `PoolMetrics`, or None for none."""
    from cluster.config import ModelConfig, TransferConfig
    from cluster.model.info import describe_model
    from cluster.serving.app_config import AppConfig
    from router.orchestrator import Orchestrator
    from router.token_stream import TokenStreamServer

    link = WorkerLink(*await asyncio.open_connection("127.0.0.1", worker_port))
    config = AppConfig(
        model=ModelConfig(path=checkpoint),
        mode="colocated",
        transfer=TransferConfig(secret="5e" * 32),
    )
    tokens = TokenStreamServer("127.0.0.1")
    await tokens.start()
    colocated = type("Colocated", (), {"generate": link})
    info = describe_model(config.model)
    return Orchestrator(config, info, None, None, colocated, tokens, metrics)


async def serve_router_path(orch):
    """`orch` behind the router's direct endpoint, served by `Router.Generate` itself: the
    started `GrpcServer` (its `endpoint` is "host:port"; it serves while the caller holds
    it)."""
    from router.direct import GrpcServer, service_methods
    from router.router import GENERATION, Router

    class Servicer:  # the router's streaming method over `orch`, nothing else
        Generate = Router.Generate
        GetModelInfo = GetStats = None

        def __init__(self) -> None:
            self.orch = orch

    server = GrpcServer("127.0.0.1")
    await server.start(service_methods(GENERATION, Servicer()))
    return server


def request(tokens: int):
    """A `GenerateRequest` for `tokens` tokens."""
    from cluster.pb.pdserve.v1 import generation_pb2 as pb

    req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3])
    req.sampling.max_tokens = tokens
    return req


async def read_stream(responses) -> tuple[list[int], int, int]:
    """(token ids, messages, finish reason) of one stream, read to its end."""
    ids: list[int] = []
    messages = finish = 0
    async for msg in responses:
        ids.extend(msg.token_ids)
        messages += 1
        finish = msg.finish_reason or finish
    return ids, messages, finish


async def read_generated(responses) -> tuple[list[int], int, int]:
    """`read_stream` of an async generator, closed whatever happens."""
    async with aclosing(responses) as stream:
        return await read_stream(stream)


def summary(results: list[tuple[list[int], int, int]], tokens: int) -> str:
    """ "tokens messages wrong": `wrong` counts streams whose tokens, or (where the stream sets
    one) finish reason, are not what was sent."""
    from cluster.pb.pdserve.v1 import generation_pb2 as pb

    want = [FIRST_TOKEN + i for i in range(tokens)]
    wrong = sum(
        ids != want or finish not in (0, pb.FINISH_REASON_LENGTH) for ids, _, finish in results
    )
    return f"{sum(len(r[0]) for r in results)} {sum(r[1] for r in results)} {wrong}"
