"""`Tally`: the router's account of one request as its chunks pass on the way to the client:
the first token's arrival, the phases each hop reports, usage, and the request's retries and
migrations; it puts finish reason, usage and timings on the last chunk and records the router's
metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.request import Request
from cluster.serving.metrics import PoolMetrics
from cluster.serving.pool_messages import WorkerChunk
from router.generation_chunk import GenerationChunk, Timing, Usage


@dataclass(slots=True)
class PrefillHop(WorkerChunk):
    """A prefill replica's token relayed as the client's chunk (the first of a request, or of
    a resume after a migration): its replica ran prefill, never the request's decode."""


class Tally:
    """Turns worker chunks into client chunks, accounting phases (and the router's metrics)
    as they pass."""

    def __init__(self, request: Request, start: float, metrics: PoolMetrics | None) -> None:
        self.request = request
        self.start = start
        self.metrics = metrics
        # The ITL histogram's recorder, looked up once per request, not per message.
        self._itl = (
            metrics.histogram_recorder("pdserve_inter_token_latency_seconds")
            if metrics is not None
            else None
        )
        self.last_at = start
        self.completion_tokens = 0
        self.cached_prompt_tokens = 0
        self.first_token_at: float | None = None
        self.queue = self.prefill = self.transfer = 0.0
        self.prefill_replica = self.decode_replica = ""
        self.attempts = 0  # calls made for it, each under an id of its own
        self.retries = 0  # hops tried again before they streamed a token
        self.migrations = 0  # generations resumed elsewhere after tokens were streamed

    def add(self, chunk: WorkerChunk) -> GenerationChunk:
        now = time.monotonic()
        out = chunk.output
        if not isinstance(chunk, PrefillHop):  # a colocated replica's first chunk too
            self.decode_replica = chunk.replica_id
        if self.first_token_at is None:
            self.first_token_at = now
            self.prefill_replica = chunk.replica_id
            self.cached_prompt_tokens = out.num_cached_tokens
            self._observe("pdserve_time_to_first_token_seconds", now - self.start)
        else:
            if out.token_ids and self._itl is not None:
                # the gap, shared by the chunk's tokens: one value per token
                itl = self._itl
                gap = (now - self.last_at) / len(out.token_ids)
                for _ in out.token_ids:
                    itl(gap)
        self.last_at = now
        self.queue += chunk.queue_seconds
        self.prefill += chunk.prefill_seconds
        self.transfer += chunk.kv_transfer_seconds
        self.completion_tokens += len(out.token_ids)
        if out.finish_reason is None:
            return GenerationChunk(
                self.request.name, out.token_ids, out.text, logprobs=out.logprobs
            )
        self._finished(out.finish_reason, now)
        return GenerationChunk(
            self.request.name,
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
                decode_replica=self.decode_replica,
                migrations=self.migrations,
            ),
        )

    def _observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(name, value)

    def _finished(self, reason: str, now: float) -> None:
        if self.metrics is None:
            return
        self.metrics.observe("pdserve_e2e_request_latency_seconds", now - self.start)
        decode = now - self.first_token_at  # as `Timing.decode_seconds`
        after_first = self.completion_tokens - 1
        self.metrics.observe("pdserve_decode_time_seconds", decode)
        self.metrics.observe("pdserve_inference_time_seconds", self.prefill + decode)
        self.metrics.observe(
            "pdserve_request_time_per_output_token_seconds",
            decode / after_first if after_first > 0 else 0.0,
        )
        self.metrics.observe("pdserve_request_max_tokens", self.request.params.max_tokens)
        self.metrics.inc("pdserve_prompt_tokens_total", len(self.request.prompt_token_ids))
        self.metrics.inc("pdserve_cached_prompt_tokens_total", self.cached_prompt_tokens)
        self.metrics.inc("pdserve_generation_tokens_total", self.completion_tokens)
        self.metrics.inc("pdserve_requests_finished_total", reason=reason)
