"""The token stream end to end on the session's "pd" app: a client slower than the stream gets
every token in fewer messages (the proxy and the router coalesce what it has not taken), and
the router replica's own gRPC endpoint (`router.direct`), listed by GetStats, serves the
same API as Serve's proxy, cancellation freeing everything as there."""

from __future__ import annotations

import time

import grpc
import pytest

from cluster.client.generation_client import GenerationClient, router_endpoints
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.e2e.conftest import PD
from tests.e2e.grpc_calls import generate, greedy_sampling, tokens
from tests.ray_fixtures import app_metadata, stub, wait_for_idle

# A client whose reads hold the stream back: it announces a 1 KiB receive window and never
# grows it (grpc's default starts at 64 KiB and grows with use, so a slow reader of a short
# answer would have every message buffered at its end before reading any).
SLOW_CLIENT = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
PROMPT = [5 + i for i in range(24)]


def router_endpoint(app: str) -> str:
    from ray import serve

    return serve.get_deployment_handle("Router", app_name=app).grpc_endpoint.remote().result()


def test_a_slow_client_gets_every_token_in_order_in_fewer_messages(apps):
    reference, _ = generate(apps, PD, prompt_token_ids=PROMPT, sampling=greedy_sampling(200))
    channel = grpc.insecure_channel(apps.grpc_target, options=SLOW_CLIENT)
    request = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy_sampling(200))
    msgs = []
    for msg in pb_grpc.GenerationStub(channel).Generate(request, metadata=app_metadata(PD)):
        msgs.append(msg)
        time.sleep(0.2)  # one message per 200 ms
    channel.close()
    assert tokens(msgs) == tokens(reference) and len(tokens(msgs)) == 200
    assert len(msgs) < 200
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(PROMPT), 200)
    assert all(not m.HasField("usage") for m in msgs[:-1])
    wait_for_idle(apps, PD, {"prefill", "decode"})


def test_the_routers_own_endpoint_is_listed_and_serves_the_same_api(apps):
    """`GenerationClient.direct` finds the router's endpoint in GetStats (through the proxy,
    and through the endpoint itself) and gets the proxy's greedy tokens from it."""
    via_proxy, _ = generate(apps, PD, prompt_token_ids=PROMPT, sampling=greedy_sampling(48))
    endpoint = router_endpoint(PD)
    request = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy_sampling(48))
    with GenerationClient.direct(apps.grpc_target, PD) as client:
        assert client.targets == [endpoint]  # the session's apps run one router replica
        assert tokens(list(client.generate(request))) == tokens(via_proxy)
        assert router_endpoints(client.stats()) == [endpoint]
    with grpc.insecure_channel(endpoint) as channel:
        direct = pb_grpc.GenerationStub(channel)
        msgs = list(direct.Generate(request))
        assert tokens(msgs) == tokens(via_proxy)
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert msgs[-1].usage.completion_tokens == 48
        info = direct.GetModelInfo(pb.GetModelInfoRequest())
        assert info.max_context_length > 0 and info.vocab_size > 0
        bad = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=0))
        with pytest.raises(grpc.RpcError) as e:
            list(direct.Generate(bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in e.value.details()


def test_a_cancel_on_the_routers_own_endpoint_frees_everything(apps):
    with grpc.insecure_channel(router_endpoint(PD)) as channel:
        sampling = pb.SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
        call = pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling)
        )
        got = 0
        for msg in call:
            got += len(msg.token_ids)
            if got >= 3:
                break
        call.cancel()
    assert got >= 3
    wait_for_idle(apps, PD, {"prefill", "decode"})


def test_a_stream_interval_sends_the_first_token_then_groups_of_n(apps, tokenizer_model_dir, hf):
    """`GenerateRequest.stream_interval` 8 over 50 greedy tokens: the first token alone
    (TTFT unchanged), then 8 tokens a message, the last 1 with the finish reason and usage;
    the transformers oracle's tokens. 0 is refused, naming the field."""
    request = pb.GenerateRequest(
        prompt_token_ids=PROMPT, sampling=greedy_sampling(50), stream_interval=8
    )
    msgs = list(stub(apps).Generate(request, metadata=app_metadata(PD)))
    assert [len(m.token_ids) for m in msgs] == [1, 8, 8, 8, 8, 8, 8, 1]
    hf.assert_greedy(tokenizer_model_dir, PROMPT, tokens(msgs), 50)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 50
    for bad in (0, 5000):
        request.stream_interval = bad
        with pytest.raises(grpc.RpcError) as e:
            list(stub(apps).Generate(request, metadata=app_metadata(PD)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stream_interval" in e.value.details()
    wait_for_idle(apps, PD, {"prefill", "decode"})
