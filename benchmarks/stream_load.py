"""N concurrent `Generate` streams from one asyncio client, each message's arrival recorded:
what the capacity benchmark sends, and the latencies it reads from what came back.

A message may carry several tokens (the serving path coalesces a stream that fell behind);
its tokens arrive together. Inter-token latency is taken as the router's metric takes it: the
gap between two messages, shared equally by the tokens of the later one, one value per token.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass
class StreamRecord:
    """One stream as the client saw it: when it was called, each message's arrival time and
    token count, and what its last message said."""

    called_at: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0
    completion_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.arrivals[0][0] - self.called_at

    def itls(self) -> list[float]:
        """One inter-token latency per token after the first message's."""
        out: list[float] = []
        for (before, _), (at, n) in zip(self.arrivals, self.arrivals[1:], strict=False):
            out.extend([(at - before) / n] * n)
        return out

    @property
    def ended_at(self) -> float:
        return self.arrivals[-1][0]


@dataclass(frozen=True)
class LoadResult:
    streams: list[StreamRecord]
    began: float
    ended: float

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.streams)

    @property
    def messages(self) -> int:
        return sum(len(s.arrivals) for s in self.streams)

    @property
    def wall_s(self) -> float:
        return self.ended - self.began

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall_s

    def ttft(self, q: float) -> float:
        return float(np.quantile([s.ttft for s in self.streams], q))

    def itl(self, q: float) -> float:
        values = [v for s in self.streams for v in s.itls()]
        return float(np.quantile(values, q)) if values else float("nan")


def greedy_request(
    prompt: list[int], max_tokens: int, stream_interval: int = 1
) -> pb.GenerateRequest:
    """`stream_interval` 1 is left to the server (whose default is 1)."""
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
    if stream_interval > 1:
        request.stream_interval = stream_interval
    return request


async def _stream(stub, request: pb.GenerateRequest, app: str) -> StreamRecord:
    record = StreamRecord(time.perf_counter())
    async for msg in stub.Generate(request, metadata=(("application", app),)):
        record.arrivals.append((time.perf_counter(), len(msg.token_ids)))
        record.token_ids.extend(msg.token_ids)
        if msg.HasField("usage"):
            record.finish_reason = msg.finish_reason
            record.completion_tokens = msg.usage.completion_tokens
    return record


async def _run_load(target: str, app: str, requests: list[pb.GenerateRequest]) -> LoadResult:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        began = time.perf_counter()
        streams = await asyncio.gather(*(_stream(stub, r, app) for r in requests))
        ended = max(s.ended_at for s in streams)
    return LoadResult(list(streams), began, ended)


def run_load(target: str, app: str, requests: list[pb.GenerateRequest]) -> LoadResult:
    """Send every request at once over one channel to `target` ("host:port": Serve's gRPC
    proxy, or a router's own endpoint); wait for all."""
    result = asyncio.run(_run_load(target, app, requests))
    for s, r in zip(result.streams, requests, strict=True):
        if len(s.token_ids) != r.sampling.max_tokens:
            raise RuntimeError(f"a stream got {len(s.token_ids)} of {r.sampling.max_tokens}")
    return result
