"""A tensor-parallel rank dies mid-stream, no request fails: an app with a prefill TP 1 pool and
two decode replicas of TP 2 each; under 12 concurrent greedy streams one decode replica's rank
1 (a Ray actor in that replica's placement group) is killed with SIGKILL. The replica's next
step fails (its collective's peer is gone, not a hang), its engine reports the fault, its
streams migrate to the other replica, and every stream ends with transformers' tokens. Serve
then replaces the whole replica (its health check fails), and every KV block and lease
returns to zero."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import grpc
import pytest

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.e2e.test_tensor_parallel_serving import follower_pids
from tests.ray_fixtures import app_metadata, deploy, small_app_config, stub, wait_for_idle

APP = "tprank"
STREAMS = 12
MAX_TOKENS = 48


def _decode_followers(ends) -> list[int]:
    """The rank-1 processes of the app's decode replicas, as GetStats lists them."""
    stats = stub(ends).GetStats(pb.GetStatsRequest(), metadata=app_metadata(APP))
    return follower_pids([r for r in stats.replicas if r.pool == "decode"])


@pytest.mark.slow
def test_a_decode_rank_killed_mid_stream_costs_no_request(ray_serve, tokenizer_model_dir, hf):
    from ray import serve

    base = small_app_config(str(tokenizer_model_dir))
    decode = replace(base.decode, tensor_parallel_size=2, replicas=2)
    deploy(replace(base, decode=decode), APP, f"/{APP}")
    try:
        deadline = time.monotonic() + 60
        while len(followers := _decode_followers(ray_serve)) != 2:  # both replicas reported
            assert time.monotonic() < deadline, followers
            time.sleep(0.5)
        s = stub(ray_serve)
        cases = [tuple((17 * i + 3 * j) % 4000 + 50 for j in range(6 + 2 * i)) for i in range(12)]
        results: list[list[pb.GenerateResponse]] = [[] for _ in cases]
        errors: list[grpc.RpcError] = []

        def run(i: int) -> None:
            sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            request = pb.GenerateRequest(prompt_token_ids=list(cases[i]), sampling=sampling)
            try:
                for msg in s.Generate(request, metadata=app_metadata(APP), timeout=180):
                    results[i].append(msg)
            except grpc.RpcError as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while not all(sum(len(m.token_ids) for m in r) >= 3 for r in results):
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.05)
        os.kill(followers[0], signal.SIGKILL)
        for t in threads:
            t.join()
        assert not errors, [(e.code(), e.details()) for e in errors]
        migrations = 0
        for ids, msgs in zip(cases, results, strict=True):
            got = [t for m in msgs for t in m.token_ids]
            hf.assert_greedy(tokenizer_model_dir, ids, got, MAX_TOKENS)
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
            migrations += msgs[-1].timing.migrations
        assert migrations >= 1  # the dead rank's replica was streaming some of them
        # Serve replaces the whole replica: two decode replicas of TP 2 again, nothing held.
        deadline = time.monotonic() + 120
        while len(now := _decode_followers(ray_serve)) != 2 or followers[0] in now:
            assert time.monotonic() < deadline, "the replica with the dead rank was not replaced"
            time.sleep(0.5)
        replicas = wait_for_idle(ray_serve, APP, {"prefill", "decode"}, timeout=90.0)
        assert sorted(r.tensor_parallel_size for r in replicas if r.pool == "decode") == [2, 2]
    finally:
        serve.delete(APP)
