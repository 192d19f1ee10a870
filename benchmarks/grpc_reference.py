"""The serving benchmark's gRPC reference rows: a bare `Generate` servicer whose streams all wake
from one event per step, served by grpc.aio and by the router's own endpoint, each in a process
of its own on uvloop (Ray's actors' loop), read by one grpc.aio client checking every stream's
tokens. The figure: the server's CPU per message. The router's endpoint exists because grpc.aio
writes each message on its own; it must cost less than grpc.aio to be kept."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics

from benchmarks.proc_stats import cpu_seconds
from benchmarks.stream_load import run_loop

FIRST_TOKEN = 100  # stream token i is FIRST_TOKEN + i
SERVERS = {"grpc.aio (reference)": False, "the router's own endpoint": True}


def serve_bare(ready, step_s: float, own_endpoint: bool) -> None:
    """The spawned server: puts its address on `ready`, then steps every `step_s`."""
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
        import grpc

        from router.direct import GrpcServer, service_methods

        servicer = Servicer()
        if own_endpoint:
            service = pb.DESCRIPTOR.services_by_name["Generation"]
            server = GrpcServer("127.0.0.1")
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


async def read_all(endpoint: str, streams: int, tokens: int) -> int:
    """Every stream read to its end; the messages received. Raises if a stream's tokens are
    not what the servicer sent."""
    import grpc

    from cluster.pb.pdserve.v1 import generation_pb2 as pb
    from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc

    want = [FIRST_TOKEN + i for i in range(tokens)]
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(i: int) -> int:
            sampling = pb.SamplingParams(max_tokens=tokens)
            req = pb.GenerateRequest(request_id=f"s{i}", prompt_token_ids=[1], sampling=sampling)
            got = [msg.token_ids for msg in [m async for m in stub.Generate(req)]]
            if [t for ids in got for t in ids] != want:
                raise RuntimeError(f"stream {i}: not the {tokens} tokens sent")
            return len(got)

        return sum(await asyncio.gather(*(one(i) for i in range(streams))))


def cpu_per_message(
    own_endpoint: bool, streams: int, tokens: int, step_s: float, repeats: int
) -> list[float]:
    """The server's µs of CPU per message, one figure per run."""
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    server = ctx.Process(target=serve_bare, args=(ready, step_s, own_endpoint), daemon=True)
    server.start()
    try:
        endpoint = ready.get(timeout=120)
        runs = []
        for _ in range(repeats):
            before = cpu_seconds({"s": server.pid})["s"]
            messages = asyncio.run(read_all(endpoint, streams, tokens))
            runs.append(1e6 * (cpu_seconds({"s": server.pid})["s"] - before) / messages)
        return runs
    finally:
        server.kill()
        server.join()


def reference_rows(streams: int, tokens: int, repeats: int, step_s: float = 0.01) -> list[str]:
    """The two servers' rows, Markdown, and whether the router's endpoint is the cheaper."""
    got = {n: cpu_per_message(own, streams, tokens, step_s, repeats) for n, own in SERVERS.items()}
    lines = [
        f"## gRPC alone: a bare servicer, {streams} streams x {tokens} one-token messages, "
        f"a step every {step_s * 1e3:g} ms",
        "",
        "| server | CPU µs / message, median | every run |",
        "|---|---|---|",
    ]
    for name, runs in got.items():
        every = ", ".join(f"{r:.1f}" for r in runs)
        lines.append(f"| {name} | {statistics.median(runs):.1f} | {every} |")
    aio, own = (statistics.median(r) for r in got.values())
    verdict = "PASS" if own < aio else "FAIL"
    lines += ["", f"The router's endpoint below grpc.aio per message: **{verdict}**", ""]
    return lines
