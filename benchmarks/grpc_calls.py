"""The benchmarks' calls to a deployed app over Serve's gRPC proxy: a timed `Generate` stream,
waiting for a new app's route, and the app's KV blocks in use."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc


def stub(grpc_port: int) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))


@dataclass(frozen=True)
class Stream:
    call_at: float
    token_times: list[float]  # arrival time of each token (messages carry one token each)
    last: pb.GenerateResponse
    token_ids: list[int]
    # `clock`'s readings when token 2 and token N arrived
    marks: tuple[Any, Any] | None = None


def served_generate(
    stub, app: str, prompt: list[int], n: int, clock: Callable[[], Any] | None = None
) -> Stream:
    """Greedy `ignore_eos` generation of `n` tokens of `prompt` by app `app`, each token's
    arrival time taken as its message comes in; with `clock`, read it at tokens 2 and N."""
    sampling = pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
    times: list[float] = []
    ids: list[int] = []
    marks: list[Any] = []
    last = None
    start = time.perf_counter()
    for msg in stub.Generate(request, metadata=(("application", app),)):
        now = time.perf_counter()
        before = len(times)
        times.extend(now for _ in msg.token_ids)
        ids.extend(msg.token_ids)
        if clock is not None and (before < 2 <= len(times) or before < n <= len(times)):
            marks.append(clock())
        last = msg
    assert last is not None and len(times) == n, f"{app}: got {len(times)} tokens, not {n}"
    return Stream(start, times, last, ids, (marks[0], marks[-1]) if clock is not None else None)


def wait_ready(stub, app: str, prompt: list[int], timeout: float = 120.0) -> None:
    """The proxy learns routes a little after `serve.run` returns: retry until one request
    goes through."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            served_generate(stub, app, prompt, 4)
            return
        except grpc.RpcError as e:
            if time.monotonic() > deadline or e.code() not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.NOT_FOUND,
            ):
                raise
            time.sleep(0.5)


def used_blocks(stub, app: str, timeout_s: float = 30.0) -> int:
    """KV blocks in use or leased over the app's replicas, once they settle (or at timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stub.GetStats(pb.GetStatsRequest(), metadata=(("application", app),))
        used = sum(r.kv_blocks_used + r.kv_blocks_leased for r in stats.replicas)
        if not used or time.monotonic() > deadline:
            return used
        time.sleep(0.5)
