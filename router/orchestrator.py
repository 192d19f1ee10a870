"""The request's path through the router, one method per hop:
  1. `build_request`: tokenize and validate; bad input is refused before any worker is touched.
  2. `_prefill`: the prefill pool computes the prompt and returns the first token and a KVHandle.
  3. the first token goes to the client at once (time to first token).
  4. `_decode`: the decode pool pulls the KV named in the handle and decodes the rest.
  5. `_relay`: the worker's engine thread sends the tokens to this router's token server
     (router/token_stream.py) for as long as the Serve call to the worker lasts; `_Tally` adds
     finish reason, usage and the phase timings to the last chunk.
In colocated mode one pool does 2-4 in one engine (`_colocated`).

`Orchestrator` is the `GenerationService` (router/generation_service.py) the API layers call.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path

from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)

from cluster.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.grpc_kv_client import GrpcKVClient
from cluster.model.info import ModelInfo
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from cluster.serving.app_config import AppConfig
from cluster.serving.metrics import PoolMetrics
from cluster.serving.pool_messages import DecodeRequest, PrefillResult, ReplicaStats, WorkerChunk
from cluster.serving.stats_registry import registry
from router.generation_chunk import GenerationChunk, Timing, Usage
from router.generation_service import ServedModel
from router.lease_releases import LeaseReleases
from router.pool_status import ClusterStats, kv_transport, pool_statuses
from router.token_stream import TokenStreamServer


class Orchestrator:
    def __init__(
        self,
        config: AppConfig,
        info: ModelInfo,
        prefill,
        decode,
        colocated,
        tokens: TokenStreamServer,
        metrics: PoolMetrics | None = None,
        app_name: str = "",
    ) -> None:
        """`prefill`, `decode` (or `colocated` alone): the pools' Serve handles; `tokens`: the
        started token stream server the workers send outputs to; `app_name`: the Serve
        application, whose pools `stats` reports."""
        self.config = config
        self.info = info
        self.tokenizer = info.tokenizer
        self.prefill = prefill
        self.decode = decode
        self.colocated = colocated
        self.tokens = tokens
        self.metrics = metrics
        self.app_name = app_name
        self.model = ServedModel(
            name=Path(config.model.path).name,
            model_id=info.model_id,
            max_context_length=info.max_model_len,
            vocab_size=info.spec.vocab_size,
            dtype=config.model.dtype,
            block_size=config.prefill.cache.block_size,
            mode=config.mode,
        )
        self.leases = LeaseReleases(
            GrpcKVClient(config.transfer.max_chunk_bytes, config.transfer.fetch_timeout_seconds),
            Capability(bytes.fromhex(config.transfer.secret)),
            self._prefill_endpoints,
        )
        self._registry = None  # the stats registry actor, looked up on first use

    def token_text(self, token_id: int) -> str:
        """A token's own text, for logprobs (`token_id:N` for a checkpoint without tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    # -- hop 1: validate -------------------------------------------------------------------

    def sampling_params(self, max_tokens: int | None = None, **fields) -> SamplingParams:
        """Fill server defaults; an unseeded random request gets a seed here, so a retried
        hop reproduces the tokens the client already has."""
        fields = {k: v for k, v in fields.items() if v is not None}
        params = SamplingParams(
            max_tokens=self.config.default_max_tokens if max_tokens is None else max_tokens,
            **fields,
        )
        if params.seed is None and not params.greedy:
            params = replace(params, seed=random.getrandbits(63))
        return params

    def build_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
        request_id: str | None = None,
    ) -> Request:
        if prompt and prompt_token_ids:
            raise InvalidArgument("give either prompt or prompt_token_ids, not both", "prompt")
        if prompt_token_ids:
            ids = [int(t) for t in prompt_token_ids]
        elif prompt:
            if self.tokenizer is None:
                raise InvalidArgument("this model has no tokenizer: send prompt_token_ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = []
        self.info.check_request(ids, params)
        return Request(request_id or uuid.uuid4().hex, tuple(ids), params)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Render chat messages with the tokenizer's chat template, ready to generate."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument("this model has no chat template", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # a template error is the caller's malformed messages
            raise InvalidArgument(f"cannot render messages: {e}", param="messages") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- hops 2-5 --------------------------------------------------------------------------

    async def generate(self, request: Request) -> AsyncIterator[GenerationChunk]:
        """Stream the request's chunks. Raises a PdServeError before the first chunk for
        refused requests; DeadlineExceeded once `request_timeout_seconds` has passed."""
        start = time.monotonic()
        deadline = start + self.config.request_timeout_seconds
        steps = (
            self._colocated(request)
            if self.config.mode == "colocated"
            else self._disaggregated(request)
        )
        tally = _Tally(request, start, self.metrics)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded(
                        f"request took longer than {self.config.request_timeout_seconds}s"
                    )
                try:
                    chunk = await asyncio.wait_for(anext(steps), remaining)
                except StopAsyncIteration:
                    return
                except BackPressureError as e:  # a pool's queue is full: refuse, don't wait
                    raise ResourceExhausted(f"the cluster is at capacity: {e}") from None
                except TimeoutError:
                    raise DeadlineExceeded(
                        f"request took longer than {self.config.request_timeout_seconds}s"
                    ) from None
                yield tally.add(chunk)
        finally:
            await steps.aclose()

    def _colocated(self, request: Request) -> AsyncIterator[WorkerChunk]:
        return self._relay(request.request_id, self.colocated.generate, request)

    async def _disaggregated(self, request: Request) -> AsyncIterator[WorkerChunk]:
        """Prefill, then decode. When the decode hop fails before its first token (the lease
        expired, a replica died), the request is prefilled again and the decode retried; the
        router fixed the seed, so the first token the client already has does not change.

        The router holds a prefilled prompt's lease from the prefill result to the decode
        worker's first chunk (by then the worker has fetched the KV and released the lease
        itself): a request that ends in between, cancelled or failed, releases it at once."""
        sent_first = False
        for attempt in range(self.config.max_retries + 1):
            result = await self._prefill(request)
            decoded = False
            try:
                if not sent_first:
                    sent_first = True
                    yield _first_chunk(result)
                if result.handle is None:
                    return
                async with aclosing(self._decode(request, result)) as chunks:
                    async for chunk in chunks:
                        decoded = True
                        yield chunk
                return
            except (asyncio.CancelledError, GeneratorExit):
                if not decoded:
                    self.leases.release(result.handle, "cancelled")
                raise
            except Exception as e:
                if not decoded:
                    self.leases.release(result.handle, "aborted")
                if decoded or attempt == self.config.max_retries or not isinstance(e, Unavailable):
                    raise

    async def _prefill(self, request: Request) -> PrefillResult:
        for attempt in range(self.config.max_retries + 1):
            try:
                return await self._prefill_call(request)
            except Unavailable:
                if attempt == self.config.max_retries:
                    raise
                await asyncio.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    async def _prefill_call(self, request: Request) -> PrefillResult:
        """One call to the prefill pool. Cancelled, it cancels the call itself, so the replica
        frees the prompt wherever it is; a result that lands anyway (the replica had finished)
        has its lease released at once rather than left to expire. A cancel that reaches the
        replica just after `PrefillWorker.prefill` returned makes Serve drop the result, handle
        and all: CancelPrefill, sent to every prefill worker, ends that lease."""
        response = self.prefill.prefill.remote(request)
        call = asyncio.ensure_future(_transient_as_unavailable(response))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self.leases.release_unclaimed)
            if not call.done():
                response.cancel()
                self.leases.cancel_prefill(request.request_id)
            raise

    async def close(self) -> None:
        """Let the lease releases on their way go out; close the KV client."""
        await self.leases.close()

    async def _decode(self, request: Request, result: PrefillResult) -> AsyncIterator[WorkerChunk]:
        decode_request = DecodeRequest(request, result.handle, result.first.token_ids[0])
        relay = self._relay(request.request_id, self.decode.decode, decode_request)
        async with aclosing(relay) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _relay(self, request_id: str, method, payload) -> AsyncIterator[WorkerChunk]:
        """Call a worker's streaming method (`method.remote(payload, route)`, a Serve handle
        call) and yield the chunks its engine thread sends to this router's token server, up to
        the last one. The call lasts as long as the stream, so Serve's queue limits, autoscaling
        and cancellation see the request. Closing early cancels the call (the worker aborts);
        after the last chunk the call is left to return by itself (the worker is finishing)."""
        with self.tokens.subscribe(request_id) as sub:
            response = method.remote(payload, sub.route)
            call = asyncio.ensure_future(_transient_as_unavailable(response))
            sub.watch(call)
            finished = False
            try:
                while not finished:
                    chunk = await sub.next()
                    finished = chunk.output.finished
                    yield chunk
            finally:
                # The stream has carried the call's outcome already; nobody awaits it any more.
                call.add_done_callback(_outcome_seen)
                if not finished and not call.done():
                    response.cancel()
                    call.cancel()

    async def _replicas(self) -> list[ReplicaStats]:
        if self._registry is None:
            self._registry = registry(self.config.name)
        return await self._registry.list.remote()

    async def _prefill_endpoints(self) -> list[str]:
        return [r.kv_endpoint for r in await self._replicas() if r.kv_endpoint]

    async def stats(self) -> ClusterStats:
        replicas = await self._replicas()
        pools = await pool_statuses(self.config, self.app_name, replicas)
        return ClusterStats(tuple(pools), tuple(replicas), kv_transport(self.config))


def _first_chunk(result: PrefillResult) -> WorkerChunk:
    """The prefill hop's token as the client's first chunk; unless the request finished on it
    ("prefilled": it goes on in decode) it is not the last."""
    first = result.first
    if result.handle is not None:
        first = replace(first, finish_reason=None)
    return WorkerChunk(
        first,
        result.replica_id,
        queue_seconds=result.queue_seconds,
        prefill_seconds=result.prefill_seconds,
    )


def _outcome_seen(call: asyncio.Future) -> None:
    if not call.cancelled():
        call.exception()  # marks it retrieved: no "Task exception was never retrieved"


async def _transient_as_unavailable(call):
    """Await a pool call; a replica that died or is unreachable becomes a retryable
    Unavailable instead of an INTERNAL error."""
    try:
        return await call
    except (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError) as e:
        raise Unavailable(f"a replica became unavailable: {type(e).__name__}") from None


class _Tally:
    """Turns worker chunks into client chunks, accounting phases (and the router's metrics)
    as they pass."""

    def __init__(self, request: Request, start: float, metrics: PoolMetrics | None) -> None:
        self.request = request
        self.start = start
        self.metrics = metrics
        self.last_at = start
        self.completion_tokens = 0
        self.cached_prompt_tokens = 0
        self.first_token_at: float | None = None
        self.queue = self.prefill = self.transfer = 0.0
        self.prefill_replica = self.decode_replica = ""

    def add(self, chunk: WorkerChunk) -> GenerationChunk:
        now = time.monotonic()
        out = chunk.output
        if self.first_token_at is None:
            self.first_token_at = now
            self.prefill_replica = chunk.replica_id
            self.cached_prompt_tokens = out.num_cached_tokens
            self._observe("pdserve_time_to_first_token_seconds", now - self.start)
        else:
            self.decode_replica = chunk.replica_id
            if out.token_ids:
                gap = (now - self.last_at) / len(out.token_ids)
                self._observe("pdserve_inter_token_latency_seconds", gap)
        self.last_at = now
        self.queue += chunk.queue_seconds
        self.prefill += chunk.prefill_seconds
        self.transfer += chunk.kv_transfer_seconds
        self.completion_tokens += len(out.token_ids)
        if out.finish_reason is None:
            return GenerationChunk(
                self.request.request_id, out.token_ids, out.text, logprobs=out.logprobs
            )
        self._finished(out.finish_reason, now)
        return GenerationChunk(
            self.request.request_id,
            out.token_ids,
            out.text,
            finish_reason=out.finish_reason,
            logprobs=out.logprobs,
            usage=Usage(
                len(self.request.prompt_token_ids),
                self.completion_tokens,
                cached_prompt_tokens=self.cached_prompt_tokens,
            ),
            timing=Timing(
                queue_seconds=self.queue,
                prefill_seconds=self.prefill,
                kv_transfer_seconds=self.transfer,
                time_to_first_token_seconds=self.first_token_at - self.start,
                decode_seconds=now - self.first_token_at,
                total_seconds=now - self.start,
                prefill_replica=self.prefill_replica,
                decode_replica=self.decode_replica or self.prefill_replica,
            ),
        )

    def _observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(name, value)

    def _finished(self, reason: str, now: float) -> None:
        if self.metrics is None:
            return
        self.metrics.observe("pdserve_e2e_request_latency_seconds", now - self.start)
        self.metrics.inc("pdserve_prompt_tokens_total", len(self.request.prompt_token_ids))
        self.metrics.inc("pdserve_cached_prompt_tokens_total", self.cached_prompt_tokens)
        self.metrics.inc("pdserve_generation_tokens_total", self.completion_tokens)
        self.metrics.inc("pdserve_requests_finished_total", reason=reason)
