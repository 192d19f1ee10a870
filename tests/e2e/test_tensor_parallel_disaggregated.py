"""A disaggregated app whose pools have different tensor-parallel sizes, end to end on a real
local Ray: prefill TP 2 -> decode TP 1 and prefill TP 1 -> decode TP 2, over each of the two
transports that move KV between TP sizes. Each decode rank gets its KV heads from the prefill
ranks that hold them: over grpc, head-sliced FetchKV from every rank's own KV server
(`cluster.kv_transfer.grpc.tp_ranks`); over nixl, head-sliced READs from every rank's own NIXL
agent (`cluster.kv_transfer.nixl.nixl_ranks`). 16 concurrent greedy requests through Serve's
proxy equal transformers, and afterwards no KV block is used or leased on either pool."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.ray_fixtures import app_metadata, deploy, small_app_config, stub, wait_for_idle

NEW_TOKENS = 8
REQUESTS = 16


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["grpc", "nixl"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_kv_moves_between_tp_sizes_and_output_equals_transformers(
    ray_serve, tokenizer_model_dir, hf, prefill_tp, decode_tp, transport
):
    from ray import serve

    app = f"tp{prefill_tp}{decode_tp}{transport}"
    base = small_app_config(str(tokenizer_model_dir))
    config = replace(
        base,
        prefill=replace(base.prefill, tensor_parallel_size=prefill_tp),
        decode=replace(base.decode, tensor_parallel_size=decode_tp),
        transfer=replace(base.transfer, transport=transport),
    )
    deploy(config, app, f"/{app}")
    try:
        s = stub(ray_serve)
        cases = [
            tuple((11 * i + 7 * j) % 4000 + 50 for j in range(5 + 3 * i)) for i in range(REQUESTS)
        ]

        def run(ids) -> list[pb.GenerateResponse]:
            sampling = pb.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            request = pb.GenerateRequest(prompt_token_ids=list(ids), sampling=sampling)
            return list(s.Generate(request, metadata=app_metadata(app), timeout=120))

        with ThreadPoolExecutor(len(cases)) as threads:
            results = list(threads.map(run, cases))
        for ids, msgs in zip(cases, results, strict=True):
            got = [t for m in msgs for t in m.token_ids]
            hf.assert_greedy(tokenizer_model_dir, ids, got, NEW_TOKENS)
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        stats = s.GetStats(pb.GetStatsRequest(), metadata=app_metadata(app))
        assert stats.kv_transport == transport
        replicas = wait_for_idle(ray_serve, app, {"prefill", "decode"})
        sizes = {r.pool: r.tensor_parallel_size for r in replicas}
        assert sizes == {"prefill": prefill_tp, "decode": decode_tp}
    finally:
        serve.delete(app)
