"""The engine with the GPU's path (one Triton kernel over the paged pool for the whole batch,
`cluster/model/triton_attention.py`, and the fused kernels that come with it,
`cluster/model/triton_fused.py`: rope + KV store, residual add + RMSNorm, SiLU * up) equals
transformers greedy and the CPU path token for token, on every architecture: decodes batched
with prompts, chunked prefill, and prompts that start from cached blocks. Without a GPU the
kernels run under Triton's interpreter (tests/conftest.py), so the engine's own batches are what
they are tested on."""

from __future__ import annotations

from collections import Counter

import pytest

from cluster.model import triton_fused
from cluster.model.triton_attention import TritonAttention
from cluster.request import Request
from tests.conftest import ARCHS, greedy, prompt, run_to_completion

pytest.importorskip("triton")

NEW = 6


@pytest.mark.parametrize("arch", list(ARCHS))
def test_triton_attention_engine_equals_the_cpu_path_and_the_oracle(
    arch, model_dir, make_engine, hf, monkeypatch
):
    calls = Counter()
    for name in ("rope_store", "add_rms_norm", "silu_mul"):
        monkeypatch.setattr(triton_fused, name, _counted(getattr(triton_fused, name), calls))
    path = model_dir(arch)
    # A small token budget chunks the 40-token prompt; "shared" starts with "long"'s first 32
    # tokens, which the prefix cache then supplies.
    settings = dict(block_size=16, max_num_batched_tokens=24)
    gpu_path, cpu_path = make_engine(path, **settings), make_engine(path, **settings)
    gpu_path.runner.varlen_attention = TritonAttention(gpu_path.runner.sliding_window)
    long = prompt(40, seed=1)
    requests = [
        Request("long", long, greedy(NEW)),
        Request("short", prompt(5, seed=2), greedy(NEW)),
        Request("one", prompt(1, seed=3), greedy(NEW)),
    ]
    shared = Request("shared", long[:32] + prompt(7, seed=4), greedy(NEW))
    for engine in (gpu_path, cpu_path):
        engine.outputs = run_to_completion(engine, requests)
        engine.outputs |= run_to_completion(engine, [shared])
    assert gpu_path.outputs["shared"].num_cached_tokens == 32  # the cached blocks were read
    assert set(calls) == {"rope_store", "add_rms_norm", "silu_mul"}  # the fused kernels ran
    for r in [*requests, shared]:
        got = gpu_path.outputs[r.request_id].token_ids
        assert got == cpu_path.outputs[r.request_id].token_ids, r.request_id
        hf.assert_greedy(path, r.prompt_token_ids, got, NEW)


def _counted(kernel, calls: Counter):
    def call(*args, **kwargs):
        calls[kernel.__name__] += 1
        return kernel(*args, **kwargs)

    return call
