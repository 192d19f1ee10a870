"""The orchestrator's retry, cancellation and deadline rules, with pool handles replaced by
doubles (the real pools are exercised end to end in tests/e2e). A retried hop must never
duplicate tokens the client has. Tokens travel as in the app: a real `TokenStreamServer` and
`TokenSender` on loopback, only the worker call is a double."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import pytest

from cluster.config import ModelConfig, TransferConfig
from cluster.engine.kv_cache import KVLayout
from cluster.errors import DeadlineExceeded, Unavailable
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.model.info import ArchSpec, ModelInfo
from cluster.request import StepOutput
from cluster.sampling_params import SamplingParams
from cluster.serving.app_config import AppConfig
from cluster.serving.pool_messages import PrefillResult, WorkerChunk
from decode_worker.token_sender import TokenSender
from router.lease_releases import LeaseReleases
from router.orchestrator import Orchestrator
from router.token_stream import TokenStreamServer
from tests.router.stream_rig import Remote

LAYOUT = KVLayout("m@0", "float32", 2, 2, 8, 16)


@dataclass
class _Call:
    """A Serve call's response: awaitable and cancellable (unless the cancel comes too late,
    when the replica has returned already)."""

    task: asyncio.Task
    too_late: bool

    def __await__(self):
        return self.task.__await__()

    def cancel(self) -> None:
        if not self.too_late:
            self.task.cancel()


def _out(rid: str, i: int, max_tokens: int, last: str = "length") -> StepOutput:
    """The fake model's output `i` of a generation: token 7 + i, text "abc..."[i]; the last
    one (`max_tokens` reached) finishes it with reason `last`."""
    done = i + 1 >= max_tokens
    return StepOutput(rid, (7 + i,), "abcdefghij"[i], last if done else None, 3, i + 1)


@dataclass
class FakePools:
    prefill_failures: int = 0
    # per decode (or colocated) call: "ok", "fail-early", "fail-late" (after one token),
    # "abort" (a worker shutting down ends the stream with finish reason "abort") or "hang"
    decode_plan: list[str] = field(default_factory=list)
    prefill_seconds: float = 0.0  # how long a prefill call takes
    cancel_too_late: bool = False  # cancelling a prefill call does not stop it
    prefill_calls: int = 0
    decode_calls: int = 0
    worker_calls: list[asyncio.Task] = field(default_factory=list)
    prefill_tasks: list[asyncio.Task] = field(default_factory=list)
    resumed_at: list[int] = field(default_factory=list)  # per call: len(output_token_ids)
    ids: list[str] = field(default_factory=list)  # per call: the request id the worker saw

    @property
    def prefill(self):
        return type("P", (), {"prefill": Remote(self._prefill_call)})()

    @property
    def decode(self):
        return type("D", (), {"decode": Remote(self._call)})()

    @property
    def colocated(self):
        return type("C", (), {"generate": Remote(self._call)})()

    def _call(self, payload, route) -> asyncio.Task:
        """A worker call (`DecodeWorker.decode`, `ColocatedWorker.generate`): a task standing
        for the Serve call, which sends the planned chunks through a real TokenSender."""
        self.worker_calls.append(asyncio.ensure_future(self._send(payload, route)))
        return self.worker_calls[-1]

    async def _send(self, payload, route):
        request = getattr(payload, "request", payload)  # a DecodeRequest, or a Request
        self.ids.append(request.request_id)
        self.resumed_at.append(len(request.output_token_ids))
        start = len(request.output_token_ids) + (payload is not request)  # decode: after first
        plan = self._worker(request, start, "c0" if payload is request else "d0")
        sender = TokenSender()
        try:
            sink = None
            async for c in plan:
                if sink is None:
                    sink = await sender.open(route, request.request_id, None)
                sink.make = lambda out, first, c=c: c  # the chunk as planned
                sink.put(c.output).flush()
                if not c.output.finished:
                    await asyncio.sleep(0.2)  # let the router take it before a planned failure
            await sink.done
            # A real handle call returns a moment after its last chunk went out.
            await asyncio.sleep(0.05)
        finally:
            sender.close()

    def _prefill_call(self, request) -> _Call:
        """A prefill call (`PrefillWorker.prefill`), standing for the Serve call."""
        self.prefill_tasks.append(asyncio.ensure_future(self._prefill(request)))
        return _Call(self.prefill_tasks[-1], self.cancel_too_late)

    async def _prefill(self, request):
        self.ids.append(request.request_id)
        self.prefill_calls += 1
        await asyncio.sleep(self.prefill_seconds)
        if self.prefill_calls <= self.prefill_failures:
            raise Unavailable("prefill replica draining")
        self.resumed_at.append(len(request.output_token_ids))
        first = _out(request.request_id, len(request.output_token_ids), request.params.max_tokens)
        if first.finished:  # the generation ended on the prefill's token
            return PrefillResult(first, None, "p0", 0.0, 0.01)
        first = replace(first, finish_reason="prefilled")
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

    async def _worker(self, request, start: int, replica: str):
        """A decode or colocated call's chunks: outputs `start`.. of the generation."""
        plan = self.decode_plan[self.decode_calls] if self.decode_plan else "ok"
        self.decode_calls += 1
        if plan == "fail-early":
            raise Unavailable("lease expired")
        rid, n = request.request_id, request.params.max_tokens
        for i in range(start, n):
            if i > start and plan == "fail-late":
                raise Unavailable("replica died")
            if i > start and plan == "abort":
                yield WorkerChunk(StepOutput(rid, (), "", "abort", 3, i), replica)
                return
            if i > start and plan == "hang":
                await asyncio.Event().wait()
            yield WorkerChunk(_out(rid, i, n), replica, prefill_seconds=0.01 * (i == 0))


class Releases:
    """Stands in for the router's KV client: counts the leases it gives back."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.cancelled: list[tuple[str, str]] = []  # CancelPrefill calls: (endpoint, request id)

    async def release(self, handle, reason):
        self.released.append(reason)
        return True

    async def cancel_prefill(self, endpoint, request_id, token):
        assert token == CAPABILITY.cancel_token(request_id)
        self.cancelled.append((endpoint, request_id))
        return False

    async def close(self) -> None:
        pass


SECRET = "5e" * 32
CAPABILITY = Capability(bytes.fromhex(SECRET))
PREFILL_ENDPOINTS = ["10.0.0.1:1", "10.0.0.2:1"]


async def prefill_endpoints() -> list[str]:
    return PREFILL_ENDPOINTS


def run(pools: FakePools, take: int | None = None, max_tokens: int = 3, **config) -> list:
    """The chunks of one request; with `take`, the client stops reading after that many."""
    return asyncio.run(run_async(pools, take, max_tokens=max_tokens, **config))[0]


async def run_async(
    pools: FakePools,
    take: int | None = None,
    releases: Releases | None = None,
    max_tokens: int = 3,
    between: float = 0.0,
    **config,
):
    """`between`: seconds the consumer spends on each chunk, outside the stream."""
    spec = ArchSpec(
        512, 64, 128, 2, 4, 2, 8, 1e-5, 256, {}, False, False, False, False, False, None
    )
    info = ModelInfo(spec, None, "m@0", frozenset(), 256)
    config = AppConfig(
        model=ModelConfig(path="/nonexistent"),
        transfer=TransferConfig(secret=SECRET),
        **{"max_retries": 2, **config},
    )
    tokens = TokenStreamServer("127.0.0.1")
    await tokens.start()
    try:
        orch = Orchestrator(config, info, pools.prefill, pools.decode, pools.colocated, tokens)
        releases = releases or Releases()
        orch.leases = LeaseReleases(releases, CAPABILITY, prefill_endpoints)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        request = await orch.build_request(None, [1, 2, 3], params, "r1")
        got = []
        stream = orch.generate(request)
        try:
            async for c in stream:
                got.append(c)
                if len(got) == take:
                    break
                await asyncio.sleep(between)
        except DeadlineExceeded:
            # The deadline's cancel, if it came, was taken back: the task is not cancelling.
            assert asyncio.current_task().cancelling() == 0
            raise
        finally:
            await stream.aclose()
            await asyncio.gather(*pools.worker_calls, return_exceptions=True)
            await orch.close()  # the lease releases still on their way
        return got, releases.released
    finally:
        assert not tokens._subs  # every subscription was closed
        await tokens.stop()


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_prefill_retried_on_unavailable():
    pools = FakePools(prefill_failures=2, decode_plan=["ok"])
    chunks = run(pools)
    assert tokens(chunks) == [7, 8, 9] and pools.prefill_calls == 3
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3


def test_decode_failing_before_its_first_token_is_redone_without_duplicates():
    pools = FakePools(decode_plan=["fail-early", "ok"])
    chunks = run(pools)
    assert tokens(chunks) == [7, 8, 9]  # the first token is sent once
    assert pools.prefill_calls == 2 and pools.decode_calls == 2


def test_decode_failing_mid_stream_migrates_without_losing_or_repeating_a_token():
    """The decode replica dies (or aborts the stream) after streaming tokens: prompt + the
    tokens the client has are prefilled again and decoding goes on elsewhere; the client sees
    one stream, and the last message counts the migration."""
    for failure in ("fail-late", "abort"):
        pools = FakePools(decode_plan=[failure, "ok"])
        chunks = run(pools, max_tokens=6)
        assert tokens(chunks) == [7, 8, 9, 10, 11, 12], failure
        assert "".join(c.text for c in chunks) == "abcdef"
        # prefill (0 done), decode, prefill of prompt + the 2 tokens streamed, decode
        assert pools.resumed_at == [0, 0, 2, 2] and pools.decode_calls == 2
        last = chunks[-1]
        assert last.finish_reason == "length" and last.usage.completion_tokens == 6
        assert last.timing.migrations == 1


def test_migrations_are_bounded():
    pools = FakePools(decode_plan=["fail-late"] * 3)
    with pytest.raises(Unavailable):
        run(pools, max_tokens=9, max_migrations=2)
    assert pools.decode_calls == 3 and pools.resumed_at[-1] == 4
    pools = FakePools(decode_plan=["fail-late", "ok"])
    with pytest.raises(Unavailable):
        run(pools, max_tokens=9, max_migrations=0)
    assert pools.decode_calls == 1


def test_a_migration_resumed_on_the_last_token_finishes_in_prefill():
    pools = FakePools(decode_plan=["fail-late"])
    chunks = run(pools, max_tokens=3)
    assert tokens(chunks) == [7, 8, 9] and chunks[-1].finish_reason == "length"
    assert pools.resumed_at == [0, 0, 2] and chunks[-1].timing.migrations == 1


def test_colocated_generation_migrates_too():
    pools = FakePools(decode_plan=["fail-late", "ok"])
    chunks = run(pools, mode="colocated", max_tokens=4)
    assert tokens(chunks) == [7, 8, 9, 10] and pools.resumed_at == [0, 1]
    assert chunks[-1].timing.migrations == 1


def test_retries_are_bounded():
    pools = FakePools(prefill_failures=10)
    with pytest.raises(Unavailable):
        run(pools)
    assert pools.prefill_calls == 3


def test_a_finished_stream_leaves_the_worker_call_to_return_by_itself():
    pools = FakePools(decode_plan=["ok"])
    chunks, released = asyncio.run(run_async(pools))
    assert tokens(chunks) == [7, 8, 9] and released == []  # the decode worker released it
    (call,) = pools.worker_calls
    assert not call.cancelled() and call.exception() is None


def test_a_stream_the_client_leaves_while_decoding_cancels_the_worker_call():
    pools = FakePools(decode_plan=["ok"])
    chunks, released = asyncio.run(run_async(pools, take=2))
    # The decode worker had the KV (it sent a token), so it released the lease itself.
    assert tokens(chunks) == [7, 8] and released == []
    (call,) = pools.worker_calls
    assert call.cancelled()


def test_a_client_leaving_after_the_first_token_gives_back_the_lease_at_once():
    pools = FakePools(decode_plan=["hang"])
    chunks, released = asyncio.run(run_async(pools, take=1))
    assert tokens(chunks) == [7] and released == ["cancelled"]


def test_a_decode_hop_failing_early_gives_back_its_lease_before_the_retry():
    pools = FakePools(decode_plan=["fail-early", "ok"])
    chunks, released = asyncio.run(run_async(pools))
    assert tokens(chunks) == [7, 8, 9] and released == ["aborted"]


def test_a_request_cancelled_during_its_prefill_cancels_the_call_or_releases_its_result():
    """The router's task is cancelled while the prefill call runs (a client that left, as
    Serve's proxy delivers it). The call is cancelled and every prefill worker is sent
    CancelPrefill (Serve may drop a result that was on its way); if the result lands anyway,
    because the replica had finished, the lease in it is released at once."""

    async def main(replica_finishes: bool) -> tuple[asyncio.Task, Releases, list[tuple]]:
        pools = FakePools(prefill_seconds=0.3, cancel_too_late=replica_finishes)
        releases = Releases()
        request = asyncio.ensure_future(run_async(pools, releases=releases))
        await asyncio.sleep(0.1)  # the prefill call is running
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        (call,) = pools.prefill_tasks
        await asyncio.gather(call, return_exceptions=True)
        await asyncio.sleep(0.05)  # the release goes out in the background
        (attempt,) = pools.ids  # cancelled by the attempt's id, never by the client's label
        assert attempt != "r1"
        return call, releases, [(e, attempt) for e in PREFILL_ENDPOINTS]

    call, releases, everywhere = asyncio.run(main(replica_finishes=False))
    assert call.cancelled() and releases.released == []
    assert releases.cancelled == everywhere
    call, releases, everywhere = asyncio.run(main(replica_finishes=True))
    assert not call.cancelled() and releases.released == ["cancelled"]
    assert releases.cancelled == everywhere


def test_a_request_whose_prefill_returned_sends_no_cancel_prefill():
    """CancelPrefill is for a prefill call cancelled while it ran; a request cancelled once it
    has its handle releases that lease by the handle, with no broadcast."""
    pools = FakePools(decode_plan=["hang"])
    releases = Releases()
    chunks, _ = asyncio.run(run_async(pools, take=1, releases=releases))
    assert tokens(chunks) == [7]
    assert releases.released == ["cancelled"] and releases.cancelled == []


def test_a_request_past_its_deadline_fails_and_cancels_the_worker_call():
    pools = FakePools(decode_plan=["hang"])
    with pytest.raises(DeadlineExceeded):
        run(pools, request_timeout_seconds=1.0)
    (call,) = pools.worker_calls
    assert call.cancelled()


def test_a_deadline_passing_while_the_consumer_is_away_ends_the_stream_at_its_next_read():
    """The deadline passes while the consumer works on a chunk (outside the stream): that work
    is not cancelled; the stream's next read raises DeadlineExceeded and cancels the call."""
    pools = FakePools(decode_plan=["ok"])  # a token each 0.2 s, 10 in all: 2 s of decode
    with pytest.raises(DeadlineExceeded):
        # first token at 0; the decode's first at 1 s, the next read at 2 s: past 1.5 s
        run(pools, max_tokens=10, request_timeout_seconds=1.5, between=1.0)
    (call,) = pools.worker_calls
    assert call.cancelled()


def test_colocated_streams_one_worker_call():
    pools = FakePools()
    chunks = run(pools, mode="colocated")
    assert tokens(chunks) == [7, 8, 9] and pools.prefill_calls == 0 and pools.decode_calls == 1
    last = chunks[-1]
    assert last.finish_reason == "length" and last.timing.prefill_replica == "c0"
    assert last.timing.prefill_seconds == pytest.approx(0.01)
