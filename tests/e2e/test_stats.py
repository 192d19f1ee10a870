"""`GetStats` is at most a second behind the engines: streams in flight are counted as running
on the decode pool, and once they are cancelled they are gone from the counts.

The clock starts when the client sees what the figures must show (every stream has a decoded
token: it is in a decode engine's batch; every call is cancelled), and the one `GetStats` sent
FRESH_WITHIN_S after that must show it. Earlier answers are only printed.
"""

from __future__ import annotations

import random
import threading
import time

import grpc

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.e2e.conftest import PD
from tests.e2e.grpc_calls import greedy_sampling
from tests.ray_fixtures import app_metadata, stub

STREAMS = 8
PROMPT_TOKENS = 32
MAX_TOKENS = 1500  # far more than the test waits for: the streams are cancelled, not finished
VOCAB = 4096  # the `tiny` preset's
FRESH_WITHIN_S = 1.0


def test_get_stats_counts_streams_in_flight_within_a_second(apps):
    s = stub(apps)
    calls, received, ended = _start_streams(s)
    try:
        decoding = _wait_until(lambda: all(n >= 2 for n in received), 60.0)
        running = _decode_counts_after(s, decoding + FRESH_WITHIN_S)
        assert running == (STREAMS, 0), f"(running, waiting) {running}, {STREAMS} decoding"
    finally:
        for c in calls:
            c.cancel()
    cancelled = time.monotonic()
    _wait_until(lambda: len(ended) == STREAMS, 10.0)
    assert ended == [grpc.StatusCode.CANCELLED] * STREAMS  # none failed or ran to its end
    assert _decode_counts_after(s, cancelled + FRESH_WITHIN_S) == (0, 0)


def _start_streams(s) -> tuple[list[grpc.Future], list[int], list]:
    """STREAMS long greedy streams with distinct prompts, each read by a thread that counts
    the tokens received so far and, at the end, appends how the stream ended (a status code,
    None if it ran to its end)."""
    received = [0] * STREAMS
    ended: list[grpc.StatusCode | None] = []
    calls = []
    for i in range(STREAMS):
        rng = random.Random(f"stats-{i}")
        request = pb.GenerateRequest(
            prompt_token_ids=[rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)],
            sampling=greedy_sampling(MAX_TOKENS),
        )
        calls.append(s.Generate(request, metadata=app_metadata(PD)))

    def read(i: int) -> None:
        code = None
        try:
            for msg in calls[i]:
                received[i] += len(msg.token_ids)
        except grpc.RpcError as e:
            code = e.code()
        ended.append(code)

    for i in range(STREAMS):
        threading.Thread(target=read, args=(i,), daemon=True).start()
    return calls, received, ended


def _wait_until(condition, timeout: float) -> float:
    """Poll `condition` until it holds; return when it was first seen true (monotonic)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout}s"
        time.sleep(0.01)
    return time.monotonic()


def _decode_counts_after(s, at: float) -> tuple[int, int]:
    """The decode pool's (running, waiting) in the first `GetStats` sent at or after `at`
    (monotonic); the answers before it are printed, to show how the figures caught up."""
    while True:
        sent = time.monotonic()
        stats = s.GetStats(pb.GetStatsRequest(), metadata=app_metadata(PD))
        decode = [r for r in stats.replicas if r.pool == "decode"]
        counts = (sum(r.running for r in decode), sum(r.waiting for r in decode))
        print(f"GetStats {sent - at:+.2f}s: decode (running, waiting) {counts}")
        if sent >= at:
            return counts
        time.sleep(0.05)
