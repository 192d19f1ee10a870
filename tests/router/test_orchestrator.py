"""The orchestrator's retry rules, with pool handles replaced by doubles (the real pools are
exercised end to end in tests/e2e). A retried hop must never duplicate tokens the client has.
Each rule is checked with both token relays: the Serve stream, and the direct token stream
(a real `TokenStreamServer` and `TokenSender` on loopback, the worker call a double)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from cluster.config import ModelConfig
from cluster.engine.kv_cache import KVLayout
from cluster.errors import Unavailable
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.model.decoder import ArchSpec
from cluster.model.loader import ModelInfo
from cluster.request import StepOutput
from cluster.sampling_params import SamplingParams
from cluster.serving.app_config import AppConfig
from cluster.serving.pool_messages import PrefillResult, WorkerChunk
from decode_worker.token_sender import TokenSender
from router.orchestrator import Orchestrator
from router.token_stream import TokenStreamServer

LAYOUT = KVLayout("m@0", "float32", 2, 2, 8, 16)


class _Remote:
    """Stands in for `handle.method.remote(...)` and `handle.options(stream=True)`."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


@dataclass
class FakePools:
    prefill_failures: int = 0
    decode_plan: list[str] = field(default_factory=list)  # per attempt: "ok", "fail-early", ...
    prefill_calls: int = 0
    decode_calls: int = 0
    worker_calls: list[asyncio.Task] = field(default_factory=list)  # the direct relay's

    @property
    def prefill(self):
        return type("P", (), {"prefill": _Remote(self._prefill)})()

    @property
    def decode(self):
        pools = self

        class D:
            decode_to = _Remote(lambda req, route: pools._call_to(req, route))

            def options(self, stream: bool):
                return type("S", (), {"decode": _Remote(pools._decode)})()

        return D()

    def _call_to(self, decode_request, route) -> asyncio.Task:
        self.worker_calls.append(asyncio.ensure_future(self._to(decode_request, route)))
        return self.worker_calls[-1]

    async def _to(self, decode_request, route):
        """The direct relay's worker call: the same plan, sent through a real TokenSender."""
        sender = TokenSender()
        chunks = self._decode(decode_request)
        try:
            sink = None
            async for c in chunks:
                if sink is None:
                    make = lambda out, first, c=c: c  # noqa: E731 - the chunk as planned
                    sink = await sender.open(route, decode_request.request.request_id, make)
                sink.make = lambda out, first, c=c: c
                sink.put(c.output).flush()
                if not c.output.finished:
                    await asyncio.sleep(0.2)  # let the router take it before a planned failure
            await sink.done
            # A real handle call returns a moment after its last chunk went out.
            await asyncio.sleep(0.05)
        finally:
            sender.close()

    async def _prefill(self, request):
        self.prefill_calls += 1
        if self.prefill_calls <= self.prefill_failures:
            raise Unavailable("prefill replica draining")
        first = StepOutput(request.request_id, (7,), "a", "prefilled", 3, 1)
        handle = KVHandle(
            request_id=request.request_id,
            num_tokens=3,
            endpoint="127.0.0.1:1",
            transport="grpc",
            block_ids=(0,),
            block_size=16,
            layout=LAYOUT,
            lease_expiry_unix=0.0,
            capability_token=b"t" * 32,
            first_token_id=7,
        )
        return PrefillResult(first, handle, "p0", 0.0, 0.01)

    async def _decode(self, decode_request):
        plan = self.decode_plan[self.decode_calls]
        self.decode_calls += 1
        if plan == "fail-early":
            raise Unavailable("lease expired")
        rid = decode_request.request.request_id
        yield WorkerChunk(StepOutput(rid, (8,), "b", None, 3, 2), "d0", kv_transfer_seconds=0.01)
        if plan == "fail-late":
            raise Unavailable("replica died")
        yield WorkerChunk(StepOutput(rid, (9,), "c", "length", 3, 3), "d0")


class NoRelease:
    async def release(self, handle, reason):
        return True


@pytest.fixture(params=["direct", "serve"])
def relay(request) -> str:
    return request.param


def run(pools: FakePools, relay: str, take: int | None = None) -> list:
    """The chunks of one request; with `take`, the client stops reading after that many."""
    spec = ArchSpec(
        512, 64, 128, 2, 4, 2, 8, 1e-5, 256, {}, False, False, False, False, False, None
    )
    info = ModelInfo(spec, None, "m@0", frozenset(), 256)
    config = AppConfig(model=ModelConfig(path="/nonexistent"), max_retries=2, token_stream=relay)

    async def go():
        tokens = TokenStreamServer("127.0.0.1") if relay == "direct" else None
        if tokens is not None:
            await tokens.start()
        orch = Orchestrator(config, info, pools.prefill, pools.decode, None, tokens=tokens)
        orch.kv_client = NoRelease()
        params = SamplingParams(max_tokens=3, temperature=0.0)
        request = orch.build_request(None, [1, 2, 3], params, "r1")
        got = []
        stream = orch.generate(request)
        try:
            async for c in stream:
                got.append(c)
                if len(got) == take:
                    break
            await stream.aclose()
            await asyncio.gather(*pools.worker_calls, return_exceptions=True)
            return got
        finally:
            if tokens is not None:
                assert not tokens._subs  # every subscription was closed
                await tokens.stop()

    return asyncio.run(go())


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_prefill_retried_on_unavailable(relay):
    pools = FakePools(prefill_failures=2, decode_plan=["ok"])
    chunks = run(pools, relay)
    assert tokens(chunks) == [7, 8, 9] and pools.prefill_calls == 3
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3


def test_decode_failing_before_its_first_token_is_redone_without_duplicates(relay):
    pools = FakePools(decode_plan=["fail-early", "ok"])
    chunks = run(pools, relay)
    assert tokens(chunks) == [7, 8, 9]  # the first token is sent once
    assert pools.prefill_calls == 2 and pools.decode_calls == 2


def test_decode_failing_mid_stream_is_not_replayed(relay):
    pools = FakePools(decode_plan=["fail-late", "ok"])
    with pytest.raises(Unavailable):
        run(pools, relay)
    assert pools.decode_calls == 1


def test_retries_are_bounded(relay):
    pools = FakePools(prefill_failures=10)
    with pytest.raises(Unavailable):
        run(pools, relay)
    assert pools.prefill_calls == 3


def test_a_finished_direct_stream_leaves_the_worker_call_to_return_by_itself():
    pools = FakePools(decode_plan=["ok"])
    assert tokens(run(pools, "direct")) == [7, 8, 9]
    (call,) = pools.worker_calls
    assert not call.cancelled() and call.exception() is None


def test_a_direct_stream_the_client_leaves_cancels_the_worker_call():
    pools = FakePools(decode_plan=["ok"])
    assert tokens(run(pools, "direct", take=2)) == [7, 8]
    (call,) = pools.worker_calls
    assert call.cancelled()
