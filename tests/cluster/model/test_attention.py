"""The C++ paged decode kernel against the torch gather + SDPA path it replaces."""

from __future__ import annotations

import shutil

import pytest
import torch

from cluster.model.attention import build_decode_group
from cluster.model.decode_attention import (
    KernelDecodeAttention,
    TorchDecodeAttention,
    load_kernel,
    select_decode_attention,
)
from tests.cluster.model.gil import other_thread_wait_s

BLOCK_SIZE = 4
NUM_BLOCKS = 48
NUM_KV_HEADS = 2
HEAD_DIM = 16
CONTEXT_LENS = (1, 4, 7, 13, 30)  # one key, one full block, and lengths between blocks


@pytest.fixture(scope="module")
def kernel():
    k = load_kernel()
    if k is None:
        if shutil.which("c++") is not None:
            pytest.fail("a C++ compiler is present but the paged attention kernel did not build")
        pytest.skip("no C++ compiler")
    return k


def random_batch(group: int, dtype: torch.dtype, seed: int = 0):
    """Queries, a random pool, and sequences whose blocks are scattered through it."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    order = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = []
    for n in CONTEXT_LENS:
        need = -(-n // BLOCK_SIZE)
        tables.append([order.pop() for _ in range(need)])
    q = torch.randn(len(CONTEXT_LENS), NUM_KV_HEADS * group, HEAD_DIM, generator=g).to(dtype)
    meta = build_decode_group(
        list(range(len(CONTEXT_LENS))), [n - 1 for n in CONTEXT_LENS], tables, torch.device("cpu")
    )
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
def test_kernel_matches_torch_path(kernel, window, group, dtype, tol) -> None:
    q, k_cache, v_cache, meta = random_batch(group, dtype)
    scale = HEAD_DIM**-0.5
    want = TorchDecodeAttention(window)(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    got = KernelDecodeAttention(window, kernel)(q, k_cache, v_cache, meta, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_torch_path_matches_direct_softmax() -> None:
    """The reference itself, against attention written out per sequence."""
    q, k_cache, v_cache, meta = random_batch(group=3, dtype=torch.float32)
    got = TorchDecodeAttention(5)(q, k_cache, v_cache, meta, 0.25)
    for b, n in enumerate(CONTEXT_LENS):
        blocks = meta.block_tables[b, : -(-n // BLOCK_SIZE)].long()
        keys = k_cache[blocks].flatten(0, 1)[max(0, n - 5) : n]  # [K, Hkv, D]
        values = v_cache[blocks].flatten(0, 1)[max(0, n - 5) : n]
        keys = keys.repeat_interleave(3, dim=1)  # [K, H, D]
        values = values.repeat_interleave(3, dim=1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[b], keys) * 0.25, dim=-1)
        torch.testing.assert_close(got[b], torch.einsum("hk,khd->hd", p, values))


def test_kernel_rejects_bad_input(kernel) -> None:
    q, k_cache, v_cache, meta = random_batch(group=1, dtype=torch.float32)
    call = kernel.paged_decode_attention
    tables, lens = meta.block_tables, meta.context_lens
    with pytest.raises(RuntimeError, match="int32"):
        call(q, k_cache, v_cache, tables.long(), lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        call(q, k_cache.double(), v_cache, tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="contiguous"):
        call(q, k_cache.transpose(0, 1), v_cache, tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="outside the pool"):
        call(q, k_cache, v_cache, tables + NUM_BLOCKS, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="context length"):
        call(q, k_cache, v_cache, tables, lens + 1000, 1.0, 0)
    with pytest.raises(RuntimeError, match="one row per sequence"):
        call(q[:2], k_cache, v_cache, tables, lens, 1.0, 0)


def test_selection(kernel) -> None:
    assert isinstance(select_decode_attention(torch.device("cpu"), None), KernelDecodeAttention)
    assert isinstance(select_decode_attention(torch.device("meta"), 8), TorchDecodeAttention)


def test_kernel_lets_other_threads_run(kernel) -> None:
    """The kernel releases the GIL. 256 sequences read one 4,096-token context (the same blocks,
    so the pool stays small) with 32 query heads per KV head: long enough to tell."""
    g = torch.Generator().manual_seed(2)
    block, context, seqs, dim = 16, 4096, 256, 128
    k_cache = torch.randn(context // block, block, 1, dim, generator=g)
    v_cache = torch.randn(context // block, block, 1, dim, generator=g)
    tables = torch.arange(context // block, dtype=torch.int32).repeat(seqs, 1)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    q = torch.randn(seqs, 32, dim, generator=g)
    call = kernel.paged_decode_attention
    waited, took = other_thread_wait_s(lambda: call(q, k_cache, v_cache, tables, lens, 0.1, 0))
    assert took > 0.05, f"the call took {took * 1e3:.1f} ms, too short to tell"
    assert waited < took / 2, f"the other thread waited {waited * 1e3:.1f} of {took * 1e3:.1f} ms"
