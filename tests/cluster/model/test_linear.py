"""The packed-weight GEMM (csrc/packed_gemm.cpp) against at::linear, and its use in the model."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from cluster.model.linear import PACKED_ROWS, Linear, load_packed_gemm, pack_linears
from cluster.request import Request
from tests.cluster.model.gil import other_thread_wait_s
from tests.conftest import greedy, prompt, run_to_completion

# (out_features, in_features): square, narrow (a GQA k/v projection), wide, and an odd size.
SHAPES = [(48, 48), (16, 48), (96, 48), (48, 96), (37, 20)]


@pytest.fixture(scope="module")
def kernel():
    k = load_packed_gemm()
    if k is None:
        if torch.backends.mkl.is_available() and shutil.which("c++") is not None:
            pytest.fail("torch has MKL and a C++ compiler is present, but packed GEMM is off")
        pytest.skip("no MKL in this torch, or no C++ compiler")
    return k


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_linear(kernel, n, k, with_bias) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    kept = None if bias is None else bias.clone()
    packed = kernel.pack_weight(w)
    for rows in [1, 2, 3, *range(PACKED_ROWS.start, PACKED_ROWS.stop + 2, 7), 300]:
        x = torch.randn(rows, k, generator=g)
        got = kernel.packed_linear(x, packed, n, k, bias)
        assert got.shape == (rows, n)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    if bias is not None:
        assert torch.equal(bias, kept), "the bias was written to"


def test_packed_linear_rejects_bad_input(kernel) -> None:
    w = torch.randn(16, 8)
    packed = kernel.pack_weight(w)
    with pytest.raises(RuntimeError, match="8 columns"):
        kernel.packed_linear(torch.randn(4, 9), packed, 16, 8, None)
    with pytest.raises(RuntimeError, match="fp32"):
        kernel.packed_linear(torch.randn(4, 8, dtype=torch.float64), packed, 16, 8, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.packed_linear(torch.randn(4, 8), packed[:-1], 16, 8, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.packed_linear(torch.randn(4, 8), packed, 4096, 8, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.packed_linear(torch.randn(4, 8), packed, 16, 8, torch.randn(15))
    with pytest.raises(RuntimeError, match="2-D fp32"):
        kernel.pack_weight(torch.randn(16, 8).to(torch.bfloat16))


def test_linear_uses_the_packed_weight_only_for_its_row_range(kernel) -> None:
    layer = Linear(48, 32)
    calls: list[int] = []
    assert pack_linears(layer) == 1
    packed = layer.packed

    def spy(x, bias):
        calls.append(x.shape[0])
        return packed(x, bias)

    object.__setattr__(layer, "packed", spy)
    rows = [1, PACKED_ROWS.start - 1, PACKED_ROWS.start, 32, PACKED_ROWS.stop - 1, PACKED_ROWS.stop]
    with torch.no_grad():
        for r in rows:
            x = torch.randn(r, 48)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == [r for r in rows if r in PACKED_ROWS]


def test_pack_linears_skips_what_it_cannot_pack(kernel) -> None:
    plain = torch.nn.Linear(8, 8)  # not pdserve's Linear
    model = torch.nn.Sequential(Linear(8, 8), Linear(8, 8).to(torch.bfloat16), plain)
    assert pack_linears(model) == 1
    assert model[0].packed is not None and model[1].packed is None


@pytest.mark.parametrize("packed", [True, False])
def test_engine_packs_fp32_cpu_models_unless_told_not_to(kernel, model_dir, make_engine, packed):
    engine = make_engine(model_dir("llama-tied"), packed_weights=packed)
    layers = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert layers and all((m.packed is not None) == packed for m in layers)


def test_packed_and_plain_engines_agree(kernel, model_dir, make_engine) -> None:
    """A batch whose decode steps run 5-8 rows (the packed range) gives the same greedy tokens
    with and without packed weights (the oracle tests compare the packed engine with HF)."""
    path = model_dir("qwen2")  # QKV bias: the packed path's bias handling is in play
    requests = [Request(f"r{i}", prompt(5 + 3 * i, seed=i), greedy(12)) for i in range(8)]
    outs = {}
    for packed in (True, False):
        engine = make_engine(path, packed_weights=packed)
        outs[packed] = {r: o.token_ids for r, o in run_to_completion(engine, requests).items()}
    assert outs[True] == outs[False]


def test_packed_linear_lets_other_threads_run(kernel) -> None:
    """The GEMM releases the GIL, so a replica's event loop runs while the engine multiplies."""
    g = torch.Generator().manual_seed(1)
    packed = kernel.pack_weight(torch.randn(4096, 4096, generator=g))
    x = torch.randn(1024, 4096, generator=g)
    waited, took = other_thread_wait_s(lambda: kernel.packed_linear(x, packed, 4096, 4096, None))
    assert took > 0.05, f"the call took {took * 1e3:.1f} ms, too short to tell"
    assert waited < took / 2, f"the other thread waited {waited * 1e3:.1f} of {took * 1e3:.1f} ms"
