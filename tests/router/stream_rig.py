"""A real `Orchestrator` (colocated mode) over a real `TokenStreamServer`, with a worker double
that streams numbered steps through a real `TokenSender` on loopback, one token per step (as
the engine makes them), at a given pace or in lockstep with whoever reads the stream; and a
metrics double that records what the router observes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from cluster.config import ModelConfig, TransferConfig
from cluster.model.info import ArchSpec, ModelInfo
from cluster.request import StepOutput
from cluster.serving.app_config import AppConfig
from cluster.serving.pool_messages import WorkerChunk
from decode_worker.token_sender import TokenSender
from router.orchestrator import Orchestrator
from router.token_stream import TokenStreamServer

PROMPT = (1, 2, 3)
FIRST_TOKEN = 100


def step_text(i: int) -> str:
    return f"<{i}>"


class Remote:
    """Stands in for `handle.method.remote(...)`."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


@dataclass
class StepWorker:
    """The colocated pool: each call streams `request.params.max_tokens` steps, token
    FIRST_TOKEN + i and text `step_text(i)` at step i, `interval_s` apart; with `lockstep`,
    step i + 1 goes out only once `taken` is set (the reader took step i)."""

    interval_s: float = 0.0
    lockstep: bool = False
    taken: asyncio.Event = field(default_factory=asyncio.Event)
    calls: list[asyncio.Task] = field(default_factory=list)

    @property
    def colocated(self):
        return type("C", (), {"generate": Remote(self._call)})()

    def _call(self, request, route) -> asyncio.Task:
        self.calls.append(asyncio.ensure_future(self._send(request, route)))
        return self.calls[-1]

    async def _send(self, request, route) -> None:
        sender = TokenSender()
        try:
            sink = await sender.open(route, request.request_id, _chunk)
            n = request.params.max_tokens
            for i in range(n):
                if self.lockstep and i > 0:
                    await self.taken.wait()
                    self.taken.clear()
                finish = "length" if i == n - 1 else None
                out = StepOutput(
                    request.request_id, (FIRST_TOKEN + i,), step_text(i), finish, 3, i + 1
                )
                sink.put(out).flush()
                await asyncio.sleep(self.interval_s)
            await sink.done
        finally:
            sender.close()


def _chunk(out: StepOutput, first: bool) -> WorkerChunk:
    return WorkerChunk(out, "w0")


@dataclass
class RecordingMetrics:
    """Stands in for `PoolMetrics`: what was observed, by name."""

    observed: dict[str, list[float]] = field(default_factory=dict)

    def observe(self, name: str, value: float, **tags: str) -> None:
        self.observed.setdefault(name, []).append(value)

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        pass

    def histogram_recorder(self, name: str, **tags: str):
        return lambda value: self.observe(name, value)

    def flush(self) -> None:
        pass  # records at once


def model_info() -> ModelInfo:
    spec = ArchSpec(
        512, 64, 128, 2, 4, 2, 8, 1e-5, 256, {}, False, False, False, False, False, None
    )
    return ModelInfo(spec, None, "m@0", frozenset(), 512)


@asynccontextmanager
async def orchestrator(
    worker: StepWorker, metrics: RecordingMetrics | None = None
) -> AsyncIterator[Orchestrator]:
    config = AppConfig(
        model=ModelConfig(path="/nonexistent/tiny"),
        mode="colocated",
        transfer=TransferConfig(secret="5e" * 32),
    )
    tokens = TokenStreamServer("127.0.0.1")
    await tokens.start()
    orch = Orchestrator(config, model_info(), None, None, worker.colocated, tokens, metrics)
    try:
        yield orch
    finally:
        await asyncio.gather(*worker.calls, return_exceptions=True)
        await orch.close()
        assert not tokens._subs  # every subscription was closed
        await tokens.stop()
