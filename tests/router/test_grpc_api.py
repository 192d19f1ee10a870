"""The gRPC contract's conversions (router/grpc_api.py) over a `GenerationService` double:
unset fields take their documented defaults, bad fields are refused naming them, and model
info, stats and the last chunk fill every field of their messages."""

from __future__ import annotations

import asyncio

import pytest

from cluster.errors import InvalidArgument, NotFound
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.request import TokenLogprobs
from cluster.serving.pool_messages import RankPlace, ReplicaStats
from router.generation_chunk import GenerationChunk, Usage
from router.grpc_api import chunk_to_proto, model_info_to_proto, request_from_proto, stats_to_proto
from router.pool_status import ClusterStats, PoolStatus
from tests.router.fake_service import MODEL, MODEL_ID, SERVER_MAX_TOKENS, TIMING, FakeService


def from_proto(msg: pb.GenerateRequest, service):
    """`request_from_proto`, run to its end."""
    return asyncio.run(request_from_proto(msg, service))


def test_unset_sampling_fields_take_the_documented_defaults():
    request = from_proto(pb.GenerateRequest(prompt_token_ids=[5, 6]), FakeService())
    p = request.params
    assert request.prompt_token_ids == (5, 6) and request.request_id
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (SERVER_MAX_TOKENS, 1.0, 1.0, 0)
    assert p.seed is not None and p.logprobs is None  # random sampling gets a seed


def test_set_fields_reach_the_request():
    sampling = pb.SamplingParams(
        max_tokens=3, temperature=0.0, top_p=0.5, top_k=4, seed=9, stop=["x"], logprobs=2
    )
    sampling.stop_token_ids.append(7)
    msg = pb.GenerateRequest(request_id="r1", prompt="abc", sampling=sampling, model=MODEL_ID)
    request = from_proto(msg, FakeService())
    p = request.params
    assert request.label == "r1" and request.request_id != "r1"
    assert len(request.prompt_token_ids) == 3
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (3, 0.0, 0.5, 4, 9)
    assert (p.stop, p.stop_token_ids, p.logprobs) == (("x",), (7,), 2)


@pytest.mark.parametrize(
    ("msg", "error", "param"),
    [
        (pb.GenerateRequest(prompt="x", model="other"), NotFound, "model"),
        (
            pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=0)),
            InvalidArgument,
            "max_tokens",
        ),
        (pb.GenerateRequest(prompt="x", prompt_token_ids=[1]), InvalidArgument, "prompt"),
    ],
)
def test_bad_fields_are_refused_naming_them(msg, error, param):
    with pytest.raises(error) as e:
        from_proto(msg, FakeService())
    assert e.value.param == param


def test_model_info_describes_the_served_model():
    info = model_info_to_proto(FakeService().model)
    assert (info.model_id, info.max_context_length, info.vocab_size) == (MODEL_ID, 128, 512)
    assert (info.dtype, info.block_size, info.mode) == ("float32", 16, "disaggregated")
    assert MODEL in FakeService().model.names


def test_stats_fill_pools_and_replicas():
    pool = PoolStatus("decode", "Decode", 1, 2, 1, 4, (("running", 3.0, 6.0),))
    replica = ReplicaStats("decode", "d0", 100, 10, 2, 3, 1, 40, kv_blocks_cached=5)
    msg = stats_to_proto(ClusterStats((pool,), (replica,), kv_transport="nixl"))
    assert msg.kv_transport == "nixl"
    (p,) = msg.pools
    assert (p.pool, p.deployment, p.current_replicas, p.target_replicas) == (
        "decode",
        "Decode",
        1,
        2,
    )
    assert (p.min_replicas, p.max_replicas) == (1, 4)
    assert [(s.name, s.value, s.target_per_replica) for s in p.signals] == [("running", 3.0, 6.0)]
    (r,) = msg.replicas
    assert (r.replica_id, r.kv_blocks_total, r.kv_blocks_used, r.kv_blocks_leased) == (
        "d0",
        100,
        10,
        2,
    )
    assert (r.running, r.waiting, r.queued_prompt_tokens, r.kv_blocks_cached) == (3, 1, 40, 5)
    assert r.grpc_endpoint == "" and not r.ranks


def test_stats_carry_where_each_tp_rank_runs():
    places = (RankPlace(0, "n" * 56, "10.0.0.7", 4100), RankPlace(1, "n" * 56, "10.0.0.7", 4101))
    replica = ReplicaStats("decode", "d0", 8, 0, 0, 0, 0, 0, tensor_parallel_size=2, ranks=places)
    (r,) = stats_to_proto(ClusterStats((), (replica,))).replicas
    got = [(p.rank, p.node_id, p.node_ip, p.pid) for p in r.ranks]
    assert got == [(0, "n" * 56, "10.0.0.7", 4100), (1, "n" * 56, "10.0.0.7", 4101)]


def test_stats_list_a_router_replica_with_its_direct_endpoint():
    router = ReplicaStats("router", "r0", 0, 0, 0, 0, 0, 0, grpc_endpoint="10.0.0.5:41000")
    (r,) = stats_to_proto(ClusterStats((), (router,))).replicas
    assert (r.pool, r.replica_id, r.grpc_endpoint, r.kv_blocks_total) == (
        "router",
        "r0",
        "10.0.0.5:41000",
        0,
    )


def test_the_last_chunk_carries_finish_reason_usage_timing_and_logprobs():
    scored = (TokenLogprobs(-0.5, ((4, -0.5), (8, -1.5))),)
    chunk = GenerationChunk("r1", (4,), "x", "length", Usage(2, 3, 1), TIMING, scored)
    msg = chunk_to_proto(chunk)
    assert (msg.request_id, list(msg.token_ids), msg.text) == ("r1", [4], "x")
    assert msg.finish_reason == pb.FINISH_REASON_LENGTH
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens) == (2, 3)
    assert msg.usage.cached_prompt_tokens == 1
    assert msg.timing.prefill_replica == "prefill-0" and msg.timing.total_seconds == 0.006
    (lp,) = msg.logprobs
    assert lp.logprob == -0.5 and [t.token_id for t in lp.top_logprobs] == [4, 8]
    first = chunk_to_proto(GenerationChunk("r1", (3,), "y"))
    assert first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert not first.HasField("usage") and not first.HasField("timing")


def test_logit_adjustments_reach_the_request():
    sampling = pb.SamplingParams(
        repetition_penalty=1.2, frequency_penalty=-0.5, presence_penalty=2.0, min_p=0.1
    )
    sampling.logit_bias[7] = -100.0
    sampling.logit_bias[3] = 2.5
    p = from_proto(pb.GenerateRequest(prompt="x", sampling=sampling), FakeService()).params
    assert p.logit_bias == ((3, 2.5), (7, -100.0))
    assert (p.frequency_penalty, p.presence_penalty) == (-0.5, 2.0)
    assert p.repetition_penalty == pytest.approx(1.2) and p.min_p == pytest.approx(0.1)
    unset = from_proto(pb.GenerateRequest(prompt="x"), FakeService()).params
    assert (unset.logit_bias, unset.repetition_penalty, unset.min_p) == ((), 1.0, 0.0)
    assert not unset.adjusts_logits


def _sampling(**fields) -> pb.SamplingParams:
    bias = fields.pop("logit_bias", {})
    s = pb.SamplingParams(**fields)
    for token, value in bias.items():
        s.logit_bias[token] = value
    return s


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        (_sampling(presence_penalty=2.5), "presence_penalty"),
        (_sampling(frequency_penalty=-3.0), "frequency_penalty"),
        (_sampling(repetition_penalty=0.0), "repetition_penalty"),  # set: 0 is not "unset"
        (_sampling(min_p=1.5), "min_p"),
        (_sampling(logit_bias={5: 101.0}), "logit_bias"),
        (_sampling(logit_bias={512: 1.0}), "logit_bias"),  # the fake's vocabulary is 512
        (_sampling(logit_bias={t: 1.0 for t in range(301)}), "logit_bias"),
    ],
)
def test_bad_logit_adjustments_are_refused_naming_them(sampling, param):
    with pytest.raises(InvalidArgument) as e:
        from_proto(pb.GenerateRequest(prompt="x", sampling=sampling), FakeService())
    assert e.value.param == param and param in e.value.message
