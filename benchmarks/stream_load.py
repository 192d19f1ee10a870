"""N concurrent `Generate` streams from one asyncio client, each message's arrival recorded:
what the serving benchmark sends, and the latencies it reads from what came back.

The client runs in a process of its own (`python -m benchmarks.stream_load`, requests in and
arrivals out as JSON on its pipes), on uvloop when it is installed, without Ray: its CPU per
token is then the client's alone, not that of the Ray driver the benchmark runs in (whose
threads cost several times a bare client's), and it takes no more of the machine's cores from
the app than a client has to.

A message may carry several tokens (the serving path coalesces a stream that fell behind);
its tokens arrive together. Inter-token latency is taken as the router's metric takes it: the
gap between two messages, shared equally by the tokens of the later one, one value per token.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass
class StreamRecord:
    """One stream as the client saw it: when it was called, each message's arrival time and
    token count, and its tokens."""

    called_at: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

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
    client_cpu_s: float = 0.0  # the client process's CPU over the load (utime + stime)

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.streams)

    @property
    def messages(self) -> int:
        return sum(len(s.arrivals) for s in self.streams)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / (self.ended - self.began)

    def ttft(self, q: float) -> float:
        return float(np.quantile([s.ttft for s in self.streams], q))

    def itl(self, q: float) -> float:
        values = [v for s in self.streams for v in s.itls()]
        return float(np.quantile(values, q)) if values else float("nan")

    def all_decoding_s(self) -> float:
        """From the load's start until every stream had its second message, i.e. was in the
        decode batch (the burst's ramp); nan if a stream ended with fewer than two."""
        second = [s.arrivals[1][0] for s in self.streams if len(s.arrivals) > 1]
        if not second or len(second) < len(self.streams):
            return float("nan")
        return max(second) - self.began


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
    return record


async def _run_load(target: str, app: str, requests: list[pb.GenerateRequest]) -> LoadResult:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        began = time.perf_counter()
        streams = await asyncio.gather(*(_stream(stub, r, app) for r in requests))
        ended = max(s.ended_at for s in streams)
    return LoadResult(list(streams), began, ended)


class LoadClient:
    """The client process for one load, started and ready (its imports done, the requests
    parsed) once constructed: `go` sends every request at once over one channel and returns
    when all streams have ended, so whatever is measured around it leaves out the client's
    start-up; `result` reads what it saw. Use it as a context manager (it kills the process
    on the way out if it is still there)."""

    def __init__(self, target: str, app: str, requests: list[pb.GenerateRequest]) -> None:
        self.requests = requests
        self.errors = tempfile.TemporaryFile("w+")  # a file: a full pipe would stall the client
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.stream_load"],
            cwd=Path(__file__).resolve().parents[1],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
        )
        blobs = [base64.b64encode(r.SerializeToString()).decode() for r in requests]
        self._say(json.dumps({"target": target, "app": app, "requests": blobs}))
        self._expect("ready")

    def go(self) -> None:
        self._say("go")
        self._expect("done")

    def result(self) -> LoadResult:
        out = self.proc.stdout.read()  # what follows "done", up to the end
        if self.proc.wait(timeout=600) != 0:
            raise RuntimeError(f"the load client failed:\n{self._stderr()}")
        result = _from_json(json.loads(out))
        for s, r in zip(result.streams, self.requests, strict=True):
            if len(s.token_ids) != r.sampling.max_tokens:
                raise RuntimeError(f"a stream got {len(s.token_ids)} of {r.sampling.max_tokens}")
        return result

    def _say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _expect(self, word: str) -> None:
        line = self.proc.stdout.readline().strip()
        if line != word:
            self.proc.kill()
            self.proc.wait(timeout=60)
            raise RuntimeError(f"the load client said {line!r}, not {word!r}:\n{self._stderr()}")

    def _stderr(self) -> str:
        self.errors.seek(0)
        return self.errors.read()[-4000:]

    def __enter__(self) -> LoadClient:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.errors.close()


def run_load(target: str, app: str, requests: list[pb.GenerateRequest]) -> LoadResult:
    """Send every request at once over one channel to `target` ("host:port": Serve's gRPC
    proxy, or a router's own endpoint), from a client process of its own; wait for all."""
    with LoadClient(target, app, requests) as client:
        client.go()
        return client.result()


def _client() -> None:
    """The client process: an order (target, app, requests) in; "ready"; on "go" the load;
    "done"; then what it saw, as `_from_json` reads it."""
    order = json.loads(sys.stdin.readline())
    requests = [pb.GenerateRequest.FromString(base64.b64decode(r)) for r in order["requests"]]
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    t0 = os.times()
    load = run_loop(_run_load(order["target"], order["app"], requests))
    t1 = os.times()
    print("done", flush=True)
    streams = [[s.called_at, s.arrivals, s.token_ids] for s in load.streams]
    cpu = (t1.user + t1.system) - (t0.user + t0.system)
    json.dump(
        {"streams": streams, "began": load.began, "ended": load.ended, "cpu_s": cpu}, sys.stdout
    )


def _from_json(got: dict) -> LoadResult:
    streams = [
        StreamRecord(called, [(at, n) for at, n in arrivals], ids)
        for called, arrivals, ids in got["streams"]
    ]
    return LoadResult(streams, got["began"], got["ended"], got["cpu_s"])


def run_loop(main):
    """`asyncio.run(main)` on uvloop (the loop Ray and Serve use) when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


if __name__ == "__main__":
    _client()
