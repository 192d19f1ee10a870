"""Sends a `Workload` to a running pdserve over the public gRPC API (or, through
`openai_load`, to any OpenAI-compatible server), each request at its arrival time (open loop:
a slow server does not slow the arrivals, only `max_concurrency` does), and records what each
stream did: when every token arrived, and the final message's usage, phase timings and
replicas. `sample_replicas` reads the pools' sizes while it runs. Requests go through Serve's
gRPC proxy, or (`direct`) straight to the routers' own endpoints.

Used by `pdserve bench` and `pdserve phases`; the clock is `time.perf_counter`, relative to
the start of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar

import grpc

from cluster.client.generation_client import FINISH_REASONS, app_metadata, router_endpoints
from cluster.client.progress import Progress
from cluster.client.workload import Workload, WorkloadRequest
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class PhaseTiming:
    """The server's account of one request (`GenerateResponse.timing`, or `pdserve_timing` on
    an OpenAI stream's last chunk), in seconds."""

    # The seconds fields, as the wire names them without their `_seconds` suffix.
    SECONDS: ClassVar = (
        "queue", "prefill", "kv_transfer", "time_to_first_token", "decode", "total"
    )  # fmt: skip

    queue: float
    prefill: float
    kv_transfer: float
    time_to_first_token: float
    decode: float
    total: float
    prefill_replica: str
    decode_replica: str

    @staticmethod
    def of(t: pb.Timing) -> PhaseTiming:
        return PhaseTiming(
            t.queue_seconds,
            t.prefill_seconds,
            t.kv_transfer_seconds,
            t.time_to_first_token_seconds,
            t.decode_seconds,
            t.total_seconds,
            t.prefill_replica,
            t.decode_replica,
        )


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds from the start of the run;
    `status` is "OK" or the gRPC status code's name."""

    index: int
    scheduled_s: float
    prompt_tokens: int
    max_tokens: int
    sent_s: float = math.nan
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # each token's arrival
    status: str = "OK"
    error: str = ""
    finish_reason: str = ""
    cached_prompt_tokens: int = 0
    reusable_tokens: int = 0
    timing: PhaseTiming | None = None
    # The server's count of output tokens where a stream's chunks are not one token each
    # (OpenAI SSE: `usage.completion_tokens`); None: one entry of `token_times` per token.
    usage_output_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def output_tokens(self) -> int:
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return len(self.token_times)

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.token_times[-1] - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for a one-token answer."""
        n = self.output_tokens
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itl_s(self) -> list[float]:
        """Gaps between the stream's token arrivals (between chunks, for OpenAI SSE)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


Send = Callable[[WorkloadRequest, "RequestRecord", float], Awaitable[None]]


async def replay(
    workload: Workload,
    send: Send,
    max_concurrency: int | None = None,
    progress: Progress | None = None,
) -> list[RequestRecord]:
    """Call `send(request, record, start)` for every request of `workload` at its arrival time
    (at most `max_concurrency` at once) and return the records in workload order. `send`
    fills the record (token times from `start`, status, usage) and never raises for a failed
    request; `progress` is told as each request goes out and ends."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(i: int, req: WorkloadRequest) -> RequestRecord:
        rec = RequestRecord(
            i, req.arrival_s, len(req.prompt_token_ids), req.max_tokens,
            reusable_tokens=req.reusable_tokens,
        )  # fmt: skip
        await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
        async with limit:
            if progress:
                progress.sent()
            await send(req, rec, start)
            if progress:
                progress.done(rec.ok)
        return rec

    try:
        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(workload.requests))))
    finally:
        if progress:
            progress.close()


async def run_workload(
    target: str,
    workload: Workload,
    application: str | None = None,
    max_concurrency: int | None = None,
    timeout_s: float = 600.0,
    ignore_eos: bool = True,
    progress: Progress | None = None,
    direct: bool = False,
) -> list[RequestRecord]:
    """Send every request of `workload` over gRPC (greedy, `max_tokens` each, EOS ignored
    unless told otherwise so outputs have the workload's lengths) and return their records
    in workload order. A request that fails is recorded with its status code; the run goes
    on. With `direct`, requests go round robin to the routers' own endpoints that `GetStats`
    through `target` lists (`direct_targets`) instead of through Serve's proxy."""
    metadata = app_metadata(application)
    targets = await direct_targets(target, application) if direct else [target]
    async with contextlib.AsyncExitStack() as channels:
        stubs = [
            pb_grpc.GenerationStub(await channels.enter_async_context(grpc.aio.insecure_channel(t)))
            for t in targets
        ]
        turn = itertools.cycle(stubs)

        async def send(req: WorkloadRequest, rec: RequestRecord, start: float) -> None:
            await _stream(next(turn), req, rec, start, metadata, timeout_s, ignore_eos)

        return await replay(workload, send, max_concurrency, progress)


async def direct_targets(target: str, application: str | None = None) -> list[str]:
    """The routers' direct gRPC endpoints `GetStats` through `target` lists, else [target]
    (as `GenerationClient.direct`)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stats = await pb_grpc.GenerationStub(channel).GetStats(
            pb.GetStatsRequest(), metadata=app_metadata(application), timeout=30
        )
    return router_endpoints(stats) or [target]


async def _stream(stub, req, rec: RequestRecord, start, metadata, timeout_s, ignore_eos) -> None:
    sampling = pb.SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    request = pb.GenerateRequest(prompt_token_ids=req.prompt_token_ids, sampling=sampling)
    rec.sent_s = time.perf_counter() - start
    last = None
    try:
        async for msg in stub.Generate(request, metadata=metadata, timeout=timeout_s):
            now = time.perf_counter() - start
            rec.token_ids.extend(msg.token_ids)
            rec.token_times.extend(now for _ in msg.token_ids)
            last = msg
    except grpc.aio.AioRpcError as e:
        rec.status, rec.error = e.code().name, e.details() or ""
        return
    if last is None or not rec.token_times:
        rec.status, rec.error = "UNKNOWN", "the stream ended without a token"
        return
    rec.finish_reason = FINISH_REASONS.get(last.finish_reason, "")
    rec.cached_prompt_tokens = last.usage.cached_prompt_tokens
    rec.timing = PhaseTiming.of(last.timing)


async def model_info(target: str, application: str | None = None) -> pb.ModelInfo:
    metadata = app_metadata(application)
    async with grpc.aio.insecure_channel(target) as channel:
        return await pb_grpc.GenerationStub(channel).GetModelInfo(
            pb.GetModelInfoRequest(), metadata=metadata, timeout=30
        )


@dataclass(frozen=True)
class ReplicaSample:
    """Each pool's running replicas (`GetStats`) `t_s` seconds after sampling began."""

    t_s: float
    replicas: dict[str, int]


async def sample_replicas(
    target: str,
    application: str | None,
    samples: list[ReplicaSample],
    interval_s: float = 1.0,
) -> None:
    """Append a `ReplicaSample` to `samples` every `interval_s` until cancelled. A failed read
    is skipped: the pools' sizes are a side view of the run, never a reason to stop it."""
    metadata = app_metadata(application)
    start = time.perf_counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        while True:
            try:
                stats = await stub.GetStats(
                    pb.GetStatsRequest(), metadata=metadata, timeout=interval_s * 5
                )
                replicas = {p.pool: p.current_replicas for p in stats.pools}
                samples.append(ReplicaSample(time.perf_counter() - start, replicas))
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(interval_s)
