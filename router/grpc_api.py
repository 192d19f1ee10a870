"""Conversions between the public gRPC contract (`pdserve.v1`) and the router's own types; a
`GenerateRequest` becomes a `Request` through the `GenerationService` (hop 1)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from cluster.errors import InvalidArgument, NotFound
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.planner.split_decision import SplitDecision
from cluster.planner.split_planner import PlannerState
from cluster.request import Request
from router.generation_chunk import GenerationChunk
from router.generation_service import GenerationService, ServedModel
from router.pool_status import ClusterStats

_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


async def request_from_proto(req: pb.GenerateRequest, service: GenerationService) -> Request:
    """Validate a GenerateRequest (unset fields take their documented defaults)."""
    if req.model and req.model not in service.model.names:
        raise NotFound(f"model {req.model!r} is not served here", param="model")
    s = req.sampling
    if s.HasField("max_tokens") and s.max_tokens == 0:
        raise InvalidArgument("sampling.max_tokens must be > 0 when set", param="max_tokens")
    params = service.sampling_params(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        logit_bias=dict(s.logit_bias),
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        min_p=s.min_p,
    )
    params.check_vocab(service.model.vocab_size)
    return await service.build_request(
        req.prompt or None,
        list(req.prompt_token_ids) or None,
        params,
        req.request_id or None,
        req.stream_interval if req.HasField("stream_interval") else None,
    )


async def generate_responses(
    req: pb.GenerateRequest, service: GenerationService
) -> AsyncIterator[pb.GenerateResponse]:
    """`Generate`'s stream, as both gRPC endpoints serve it (Serve's proxy and the router's
    own): the request validated, then a response per chunk; closing it early closes the
    service's stream (which aborts the request and frees its KV)."""
    request = await request_from_proto(req, service)
    async with aclosing(service.generate(request)) as chunks:
        async for chunk in chunks:
            yield chunk_to_proto(chunk)


def chunk_to_proto(chunk: GenerationChunk) -> pb.GenerateResponse:
    """One response per chunk. Runs for every message the router streams: fields a chunk does
    not have are left unset, not set empty (even an empty `logprobs` list costs a copy)."""
    msg = pb.GenerateResponse(
        request_id=chunk.request_id, token_ids=chunk.token_ids, text=chunk.text
    )
    if chunk.logprobs:
        msg.logprobs.extend(
            pb.TokenLogprob(
                logprob=lp.logprob,
                top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            )
            for lp in chunk.logprobs
        )
    if chunk.finish_reason is not None:
        msg.finish_reason = _FINISH[chunk.finish_reason]
    if chunk.usage is not None:
        u = chunk.usage
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
            )
        )
    if chunk.timing is not None:
        t = chunk.timing
        msg.timing.CopyFrom(
            pb.Timing(
                queue_seconds=t.queue_seconds,
                prefill_seconds=t.prefill_seconds,
                kv_transfer_seconds=t.kv_transfer_seconds,
                time_to_first_token_seconds=t.time_to_first_token_seconds,
                decode_seconds=t.decode_seconds,
                total_seconds=t.total_seconds,
                prefill_replica=t.prefill_replica,
                decode_replica=t.decode_replica,
                migrations=t.migrations,
            )
        )
    return msg


def model_info_to_proto(model: ServedModel) -> pb.ModelInfo:
    return pb.ModelInfo(
        model_id=model.model_id,
        max_context_length=model.max_context_length,
        vocab_size=model.vocab_size,
        dtype=model.dtype,
        block_size=model.block_size,
        mode=model.mode,
        sampling_defaults=dict(model.sampling_defaults),
    )


def stats_to_proto(stats: ClusterStats) -> pb.ClusterStats:
    return pb.ClusterStats(
        pools=[
            pb.PoolStatus(
                pool=p.pool,
                deployment=p.deployment,
                current_replicas=p.current_replicas,
                target_replicas=p.target_replicas,
                min_replicas=p.min_replicas,
                max_replicas=p.max_replicas,
                signals=[
                    pb.LoadSignal(name=n, value=v, target_per_replica=t) for n, v, t in p.signals
                ],
            )
            for p in stats.pools
        ],
        replicas=[
            pb.ReplicaStats(
                pool=s.pool,
                replica_id=s.replica_id,
                kv_blocks_total=s.kv_blocks_total,
                kv_blocks_used=s.kv_blocks_used,
                kv_blocks_leased=s.kv_blocks_leased,
                running=s.running,
                waiting=s.waiting,
                queued_prompt_tokens=s.queued_prompt_tokens,
                kv_blocks_cached=s.kv_blocks_cached,
                generated_tokens=s.generated_tokens,
                grpc_endpoint=s.grpc_endpoint,
                device=s.device,
                dtype=s.dtype,
                tensor_parallel_size=s.tensor_parallel_size,
                state=s.state,
                ranks=[
                    pb.RankPlace(rank=r.rank, node_id=r.node_id, node_ip=r.node_ip, pid=r.pid)
                    for r in s.ranks
                ],
            )
            for s in stats.replicas
        ],
        kv_transport=stats.kv_transport,
        ratio_policy=ratio_policy_to_proto(stats.ratio_policy),
    )


def ratio_policy_to_proto(state: PlannerState | None) -> pb.RatioPolicyStatus | None:
    """The ratio policy's state as `GetStats` reports it; None (unset) without the policy."""
    if state is None:
        return None

    def split(d: SplitDecision, at: float = 0.0) -> pb.SplitDecision:
        return pb.SplitDecision(
            prefill_replicas=d.prefill_replicas,
            decode_replicas=d.decode_replicas,
            mean_input_tokens=d.mean_input,
            mean_output_tokens=d.mean_output,
            rate_rps=d.rate_rps,
            goodput_rps=d.goodput_rps,
            attainment=d.attainment,
            decided_at=at,
        )

    current = None
    if state.decision is not None:
        at = max((t for t, d in state.history if d.split == state.decision.split), default=0.0)
        current = split(state.decision, at)
    return pb.RatioPolicyStatus(
        current=current,
        reason=state.reason,
        history=[split(d, t) for t, d in state.history],
        updated_at=state.updated_at,
    )
