"""Failures end to end, on the session's apps: a forged capability token, a layout mismatch
and an expired lease fail the decode hop with their documented codes, bad requests get theirs,
and the app keeps serving with nothing left pinned."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace

import grpc
import pytest

from cluster.errors import FailedPrecondition, Unauthenticated, Unavailable
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from cluster.serving.pool_messages import DecodeRequest, WorkerChunk
from router.token_stream import TokenStreamServer
from tests.e2e.conftest import PD
from tests.e2e.grpc_calls import generate, greedy_sampling, tokens
from tests.ray_fixtures import wait_for_idle


def _prefill(rid: str):
    from ray import serve

    prefill = serve.get_deployment_handle("Prefill", app_name=PD)
    request = Request(rid, (5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21))
    request = replace(request, params=SamplingParams(max_tokens=4, temperature=0.0))
    return request, prefill.prefill.remote(request).result()


def _decode(request, handle, first_token: int) -> list[WorkerChunk]:
    """The decode hop as the router makes it: a Serve call to `DecodeWorker.decode`, whose
    engine thread sends the chunks to a token server here. Raises the call's error."""
    from ray import serve

    decode = serve.get_deployment_handle("Decode", app_name=PD)

    async def run() -> list[WorkerChunk]:
        server = TokenStreamServer("127.0.0.1")
        await server.start()
        try:
            with server.subscribe(request.request_id) as sub:
                payload = DecodeRequest(request, handle, first_token)
                call = asyncio.ensure_future(decode.decode.remote(payload, sub.route))
                sub.watch(call)
                chunks = [await sub.next()]
                while not chunks[-1].output.finished:
                    chunks.append(await sub.next())
                await call
                return chunks
        finally:
            await server.stop()

    return asyncio.run(run())


def test_bad_token_expired_lease_and_layout_mismatch_fail_with_documented_codes(apps):
    from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient

    # A forged capability token is refused by the prefill replica's KV server.
    request, result = _prefill("forged")
    forged = replace(result.handle, capability_token=b"\0" * len(result.handle.capability_token))
    with pytest.raises(Unauthenticated):
        _decode(request, forged, result.first.token_ids[0])
    # The real token still works afterwards: the lease was not consumed by the forgery.
    chunks = _decode(request, result.handle, result.first.token_ids[0])
    assert chunks[-1].output.finish_reason == "length"

    # A handle whose layout differs from the decode pool's fails before any transfer.
    request, result = _prefill("mismatch")
    other = replace(result.handle, layout=replace(result.handle.layout, model_id="other@0"))
    with pytest.raises(FailedPrecondition):
        _decode(request, other, result.first.token_ids[0])
    # ... and the KV server refuses a receiver whose layout differs, too.
    client = GrpcKVClient(1 << 20, 10.0)
    with pytest.raises(FailedPrecondition):
        asyncio.run(client.fetch(result.handle, replace(result.handle.layout, head_dim=8)))
    assert asyncio.run(client.release(result.handle, "aborted"))

    # A fetch after the lease expired fails (retryably) and never reads freed blocks.
    request, result = _prefill("expired")
    time.sleep(result.handle.lease_expiry_unix - time.time() + 1.5)
    with pytest.raises(Unavailable):
        _decode(request, result.handle, result.first.token_ids[0])

    # The workers keep serving, and nothing is left pinned.
    msgs, _ = generate(apps, PD, prompt="still serving", sampling=greedy_sampling(5))
    assert len(tokens(msgs)) == 5
    wait_for_idle(apps, PD, {"prefill", "decode"})


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "x", "sampling": pb.SamplingParams(max_tokens=0)}, "INVALID_ARGUMENT"),
        ({"prompt": "x", "sampling": pb.SamplingParams(temperature=-1)}, "INVALID_ARGUMENT"),
        ({"prompt": "x", "sampling": pb.SamplingParams(temperature=math.nan)}, "INVALID_ARGUMENT"),
        ({"prompt": "x", "sampling": pb.SamplingParams(top_p=0.0)}, "INVALID_ARGUMENT"),
        ({"prompt_token_ids": [1, 999999]}, "INVALID_ARGUMENT"),
        ({"prompt_token_ids": [5] * 5000}, "INVALID_ARGUMENT"),
        ({"prompt": "x", "prompt_token_ids": [5]}, "INVALID_ARGUMENT"),
        ({"prompt": "x", "model": "no-such-model"}, "NOT_FOUND"),
    ],
)
def test_bad_requests_get_documented_status_and_service_continues(apps, fields, code):
    code = code if isinstance(code, grpc.StatusCode) else getattr(grpc.StatusCode, code)
    with pytest.raises(grpc.RpcError) as err:
        generate(apps, PD, **fields)
    assert err.value.code() == code, err.value.details()
    msgs, _ = generate(apps, PD, prompt="ok", sampling=greedy_sampling(2))
    assert len(tokens(msgs)) == 2
