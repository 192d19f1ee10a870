"""The request's path through the router, one method per hop:
  1. `build_request`: tokenize and validate; bad input is refused before any worker is touched.
  2. `_prefill`: the prefill pool computes the prompt and returns the first token and a KVHandle.
  3. the first token goes to the client at once (time to first token).
  4. `_decode`: the decode pool pulls the KV named in the handle and decodes the rest.
  5. `_relay`: the worker's output thread sends the tokens to this router's token server
     (router/token_stream.py) for as long as the Serve call to the worker lasts; what arrived
     while the client's side was busy goes on as one chunk; `Tally` adds finish reason, usage
     and the phase timings to the last chunk.
In colocated mode one pool does 2-4 in one engine (`_colocated`).

`Orchestrator` is the `GenerationService` (router/generation_service.py) the API layers call.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, fields, replace

from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)

from cluster.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.kv_control import KVControl
from cluster.model.info import ModelInfo
from cluster.planner.split_planner import planner_state
from cluster.request import MAX_STREAM_INTERVAL, Request, check_request_id
from cluster.sampling_params import SamplingParams
from cluster.serving.app_config import AppConfig
from cluster.serving.metrics import PoolMetrics
from cluster.serving.pool_messages import DecodeRequest, PrefillResult, ReplicaStats, WorkerChunk
from cluster.serving.stats_registry import registry
from router.attempt import new_request_id, resume_of, retry_of
from router.chat.chat_plan import chat_options
from router.deadline import Deadline
from router.generation_chunk import GenerationChunk
from router.generation_service import served_model
from router.lease_releases import LeaseReleases
from router.pool_status import ClusterStats, kv_transport, pool_statuses
from router.prompt_tokenizer import PromptTokenizer
from router.tally import PrefillHop, Tally
from router.token_stream import TokenStreamServer


@dataclass(frozen=True)
class _ServerMaxTokens(SamplingParams):
    """Sampling parameters whose `max_tokens` the client left to the server: `build_request`
    fits the server's default to what the context leaves after the prompt."""


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
        self.prompts = PromptTokenizer(info.tokenizer, info.max_model_len)
        self.chat_prompt = self.prompts.chat  # GenerationService.chat_prompt
        self.tokenize = self.prompts.encode
        self.chat_options = chat_options(config)
        self.prefill = prefill
        self.decode = decode
        self.colocated = colocated
        self.tokens = tokens
        self.metrics = metrics
        self.app_name = app_name
        self.model = served_model(config, info)
        self.leases = LeaseReleases(
            KVControl(config.transfer.max_chunk_bytes, config.transfer.fetch_timeout_seconds),
            Capability(bytes.fromhex(config.transfer.secret)),
            self._prefill_endpoints,
        )
        self._registry = None  # the stats registry actor, looked up on first use

    def detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            raise InvalidArgument("this model has no tokenizer", param="tokens")
        return self.tokenizer.decode(token_ids)

    def token_text(self, token_id: int) -> str:
        """A token's own text, for logprobs (`token_id:N` for a checkpoint without tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    # -- hop 1: validate -------------------------------------------------------------------

    def sampling_params(self, max_tokens: int | None = None, **fields) -> SamplingParams:
        """Fill server defaults; an unseeded random request gets a seed here, so a retried
        hop reproduces the tokens the client already has."""
        fields = {
            **dict(self.model.sampling_defaults),
            **{k: v for k, v in fields.items() if v is not None},
        }
        params = SamplingParams(
            max_tokens=self.config.default_max_tokens if max_tokens is None else max_tokens,
            **fields,
        )
        if params.seed is None and not params.greedy:
            params = replace(params, seed=random.getrandbits(63))
        return params if max_tokens is not None else _ServerMaxTokens(**_fields(params))

    async def build_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
        request_id: str | None = None,
        stream_interval: int | None = None,
    ) -> Request:
        if request_id:
            check_request_id(request_id)
        if prompt and prompt_token_ids:
            raise InvalidArgument("give either prompt or prompt_token_ids, not both", "prompt")
        if prompt_token_ids:
            self._check_prompt_length(len(prompt_token_ids))  # before a pass over them
            ids = [int(t) for t in prompt_token_ids]
        elif prompt:
            ids = await self.prompts.encode(prompt)
        else:
            ids = []
        if isinstance(params, _ServerMaxTokens):  # fit the server's default to the context
            fitted = self.info.default_max_tokens(ids, params.max_tokens)
            params = SamplingParams(**{**_fields(params), "max_tokens": fitted})
        self.info.check_request(ids, params)
        if stream_interval is None:
            stream_interval = self.config.stream_interval
        elif not 1 <= stream_interval <= MAX_STREAM_INTERVAL:
            raise InvalidArgument(
                f"stream_interval must be in 1..{MAX_STREAM_INTERVAL}, got {stream_interval}",
                param="stream_interval",
            )
        return Request(
            new_request_id(),
            tuple(ids),
            params,
            stream_interval=stream_interval,
            label=request_id or "",
        )

    def _check_prompt_length(self, n: int) -> None:
        if n >= self.info.max_model_len:
            raise InvalidArgument(
                f"this model's context is {self.info.max_model_len} tokens, and the prompt has "
                f"{n}: it must leave room for at least one generated token",
                param="prompt",
            )

    # -- hops 2-5 --------------------------------------------------------------------------

    async def generate(self, request: Request) -> AsyncIterator[GenerationChunk]:
        """Stream the request's chunks. Raises a PdServeError before the first chunk for
        refused requests; DeadlineExceeded once `request_timeout_seconds` has passed."""
        start = time.monotonic()
        tally = Tally(request, start, self.metrics)
        steps = (
            self._colocated(request, tally)
            if self.config.mode == "colocated"
            else self._disaggregated(request, tally)
        )
        deadline = Deadline(start + self.config.request_timeout_seconds)
        try:
            while not deadline.expired:
                try:
                    with deadline:
                        chunk = await anext(steps)
                except StopAsyncIteration:
                    return
                except BackPressureError as e:  # a pool's queue is full: refuse, don't wait
                    raise ResourceExhausted(f"the cluster is at capacity: {e}") from None
                except asyncio.CancelledError:
                    if not deadline.cancelled_it():
                        raise
                    break
                yield tally.add(chunk)
            raise DeadlineExceeded(
                f"request took longer than {self.config.request_timeout_seconds}s"
            )
        finally:
            deadline.close()
            await steps.aclose()

    async def _colocated(self, request: Request, tally: Tally) -> AsyncIterator[WorkerChunk]:
        """One colocated call; if it fails (UNAVAILABLE: a replica died, a stream was lost or
        aborted) the generation resumes on another replica from the tokens the client has."""
        done: list[int] = []  # the tokens the client has
        while True:
            streamed = False
            try:
                attempt = resume_of(request, done) if tally.attempts else request
                tally.attempts += 1
                relay = self._relay(attempt.request_id, self.colocated.generate, attempt)
                async with aclosing(relay) as chunks:
                    async for chunk in chunks:
                        streamed = True
                        done.extend(chunk.output.token_ids)
                        yield chunk
                return
            except Exception as e:
                if not self._may_resume(e, streamed, tally, "colocated"):
                    raise

    async def _disaggregated(self, request: Request, tally: Tally) -> AsyncIterator[WorkerChunk]:
        """Prefill, then decode. When a hop fails with UNAVAILABLE (a replica died, a lease
        expired, a token stream was lost or aborted) the generation resumes from the tokens the
        client has: prompt + those tokens are prefilled again (the prefix cache and affinity
        make that cheap) and decoded on a live replica. The router fixed the seed and sampling
        depends on (seed, position) only, so the client sees one stream, no token lost or
        repeated. `max_retries` bounds resumes before any decoded token, `max_migrations`
        those after (decode migration).

        The router holds a prefilled prompt's lease from the prefill result to the decode
        worker's first chunk (by then the worker has fetched the KV and released the lease
        itself): a request that ends in between, cancelled or failed, releases it at once."""
        done: list[int] = []  # the tokens the client has
        while True:
            first = resume_of(request, done) if tally.attempts else request
            tally.attempts += 1
            resumed, result = await self._prefill(first)
            decoded = False
            try:
                done.extend(result.first.token_ids)
                yield _first_chunk(result)
                if result.handle is None:
                    return
                async with aclosing(self._decode(resumed, result)) as chunks:
                    async for chunk in chunks:
                        decoded = True
                        done.extend(chunk.output.token_ids)
                        yield chunk
                return
            except (asyncio.CancelledError, GeneratorExit):
                if not decoded:
                    self.leases.release(result.handle, "cancelled")
                raise
            except Exception as e:
                if not decoded:
                    self.leases.release(result.handle, "aborted")
                if not self._may_resume(e, decoded, tally, "decode"):
                    raise

    def _may_resume(self, e: Exception, streamed: bool, tally: Tally, pool: str) -> bool:
        """Whether a hop that failed with `e` is tried again from where the client is: on
        UNAVAILABLE only, within `max_migrations` once the failed hop had streamed tokens,
        else within `max_retries`."""
        if not isinstance(e, Unavailable):
            return False
        if not streamed:
            tally.retries += 1
            return tally.retries <= self.config.max_retries
        if tally.migrations >= self.config.max_migrations:
            return False
        tally.migrations += 1
        if self.metrics is not None:
            self.metrics.inc("pdserve_request_migrations_total", from_pool=pool)
        return True

    async def _prefill(self, request: Request) -> tuple[Request, PrefillResult]:
        """Prefill `request`, retried on UNAVAILABLE; each call is an attempt with an id of its
        own. Returns the attempt that succeeded (the decode hop goes on under its id: the
        lease is keyed by it) and its result."""
        for attempt in range(self.config.max_retries + 1):
            try:
                call = retry_of(request) if attempt else request
                return call, await self._prefill_call(call)
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
        """Let the lease releases on their way go out; close the KV client and the tokenizer's
        threads; record the metric values still batched."""
        await self.leases.close()
        self.prompts.close()
        if self.metrics is not None:
            self.metrics.flush()

    def _decode(self, request: Request, result: PrefillResult) -> AsyncIterator[WorkerChunk]:
        decode_request = DecodeRequest(request, result.handle, result.first.token_ids[0])
        return self._relay(request.request_id, self.decode.decode, decode_request)

    async def _relay(self, request_id: str, method, payload) -> AsyncIterator[WorkerChunk]:
        """Call a worker's streaming method (`method.remote(payload, route)`, a Serve handle
        call) and yield the chunks its output thread sends to this router's token server, up to
        the last one; each yield carries every step that arrived since the previous one was
        taken (`Subscription.next`), so a stream whose client side falls behind catches up in
        fewer, larger messages. The call lasts as long as the stream, so Serve's queue limits,
        autoscaling and cancellation see the request. Closing early cancels the call (the
        worker aborts); after the last chunk the call is left to return by itself (the worker
        is finishing)."""
        with self.tokens.subscribe(request_id) as sub:
            response = method.remote(payload, sub.route)
            call = asyncio.ensure_future(_transient_as_unavailable(response))
            sub.watch(call)
            finished = False
            try:
                while not finished:
                    chunk = await sub.next()  # all that arrived since the last one, merged
                    finished = chunk.output.finished
                    if chunk.output.finish_reason == "abort":  # the worker gave up on it
                        if chunk.output.token_ids:  # steps it sent before, merged with it
                            yield replace(chunk, output=replace(chunk.output, finish_reason=None))
                        raise Unavailable(f"replica {chunk.replica_id} aborted the stream")
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
        ratio = await planner_state(self.app_name) if self.config.autoscaling.ratio_policy else None
        return ClusterStats(tuple(pools), tuple(replicas), kv_transport(self.config), ratio)


def _fields(params: SamplingParams) -> dict:
    """`params`' fields by name (not `vars`: it also holds cached properties)."""
    return {f.name: getattr(params, f.name) for f in fields(params)}


def _first_chunk(result: PrefillResult) -> PrefillHop:
    """The prefill hop's token as the client's first chunk; unless the request finished on it
    ("prefilled": it goes on in decode) it is not the last."""
    first = result.first
    if result.handle is not None:
        first = replace(first, finish_reason=None)
    return PrefillHop(
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
