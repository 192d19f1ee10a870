"""Decode steps replayed from graphs (`cluster/engine/cuda_graphs.py`) give the tokens eager steps
give, and their padding rows never touch a live KV block; no step of the GPU's path, captured
or eager, dispatches an op that waits on the device.

On the CPU the engine runs the GPU's attention path (the Triton kernel, under Triton's
interpreter: tests/conftest.py) with `replay_by_calling` standing in for a CUDA graph capture:
the same static buffers, bucket choice and padding, each replay running the captured callable
again. The `gpu` tests capture real CUDA graphs (`model.cuda_graphs`, on by default) and compare
them with `cuda_graphs=False` on every architecture, in fp32 and bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from benchmarks.launch_count import HOST_SYNCS, dispatched
from cluster.engine.cuda_graphs import capture_decode_graphs, capture_sizes, replay_by_calling
from cluster.engine.engine import Engine
from cluster.model.triton_attention import TritonAttention
from cluster.request import Request, RequestOutput
from cluster.sampling_params import SamplingParams
from tests.cluster.engine.test_engine_bf16 import assert_argmax_up_to_rounding
from tests.conftest import ARCHS, drive, greedy, prompt, record_plans, step_into

pytest.importorskip("triton")

MAX_SEQS = 8  # buckets 1, 2, 4, 8
SETTINGS = dict(block_size=16, max_num_batched_tokens=24, max_num_seqs=MAX_SEQS)


@dataclass
class Replays:
    """The (sequences, bucket) of every graph replay of an engine."""

    log: list[tuple[int, int]] = field(default_factory=list)


def on_the_cpu_with_graphs(engine: Engine) -> Replays:
    """Put a CPU engine on the GPU's attention path with decode graphs (`replay_by_calling`);
    what it replays is logged in the returned `Replays`."""
    runner = engine.runner
    runner.varlen_attention = TritonAttention(runner.sliding_window)
    runner.graphs = capture_decode_graphs(
        runner.model,
        engine.kv_cache,
        runner.varlen_attention,
        engine.config.scheduler.max_num_seqs,
        engine.max_model_len,
        engine.device,
        capture=replay_by_calling,
    )
    return watch(engine)


def watch(engine: Engine) -> Replays:
    graphs, replays = engine.runner.graphs, Replays()
    run = graphs.run

    def logged(step):
        replays.log.append((len(step.lens), graphs.bucket(len(step.lens))))
        return run(step)

    graphs.run = logged
    return replays


def workload(engine: Engine) -> dict[str, RequestOutput]:
    """Sequences finishing at different steps (batches that pad to a bucket), others joining
    between steps, a chunked 40-token prompt, and decodes that cross into a new KV block
    (block tables that grow during decode)."""
    first = [
        Request("long", prompt(40, seed=1), greedy(10)),
        Request("cross", prompt(14, seed=2), greedy(8)),  # positions 14..21: a second block
        Request("brief", prompt(1, seed=3), greedy(3)),
    ]
    later = [
        Request("late", prompt(9, seed=4), greedy(9)),
        Request("later", prompt(30, seed=5), greedy(5)),
        Request("also", prompt(3, seed=6), greedy(7)),
    ]
    results: dict[str, RequestOutput] = {}
    for r in first:
        engine.add_request(r)
    for _ in range(5):
        step_into(engine, results)
    for r in later:
        engine.add_request(r)
    return drive(engine, results)


def prompts_of() -> dict[str, tuple[int, ...]]:
    seeds = {"long": (40, 1), "cross": (14, 2), "brief": (1, 3), "late": (9, 4)}
    seeds |= {"later": (30, 5), "also": (3, 6)}
    return {rid: prompt(n, seed=s) for rid, (n, s) in seeds.items()}


def test_capture_sizes_are_vllms_buckets_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert capture_sizes(300)[-5:] == [248, 256, 272, 288, 300]


# Under the interpreter each architecture costs CI ~20 s; the graph wrapper does not depend on
# it, so the CPU stand-in runs one (mistral: GQA and a sliding window). The interpreter covers
# all six on the eager Triton path (test_triton_engine.py) and the `gpu` test below replays
# real graphs on all six.
@pytest.mark.parametrize("arch", ["mistral"])
def test_replayed_decode_steps_give_the_eager_tokens(arch, model_dir, make_engine, hf):
    path = model_dir(arch)
    graphed, eager = make_engine(path, **SETTINGS), make_engine(path, **SETTINGS)
    replays = on_the_cpu_with_graphs(graphed)
    eager.runner.varlen_attention = TritonAttention(eager.runner.sliding_window)
    plans = record_plans(graphed)
    got, want = workload(graphed), workload(eager)
    decode_steps = [p for p in plans if p.scheduled and p.num_tokens == len(p.scheduled)]
    assert len(replays.log) == len(decode_steps)  # every pure decode step, and only those
    assert any(n < bucket for n, bucket in replays.log)  # some were padded
    assert {bucket for _, bucket in replays.log} >= {2, 4, 8}
    for rid, ids in prompts_of().items():
        assert got[rid].token_ids == want[rid].token_ids, rid
        hf.assert_greedy(path, ids, got[rid].token_ids, len(got[rid].token_ids))


def pool_slots(engine: Engine) -> torch.Tensor:
    """Keys and values of every slot of the pool, one row per (layer, slot): `[2, L, slots, -1]`."""
    k, v = engine.kv_cache.k, engine.kv_cache.v
    return torch.stack([k, v]).flatten(2, 3).flatten(3).cpu().clone()


def check_padding_stays_in_scratch(engine: Engine, replays: Replays) -> None:
    """Step `engine` through `workload`; at every padded replay, only the slots of the step's
    new tokens and the scratch block may change."""
    bs, block = engine.layout.block_size, engine.kv_cache.scratch_block
    scratch = set(range(block * bs, (block + 1) * bs))
    schedule, step, written, padded = engine.scheduler.schedule, engine.step, [], []

    def schedule_and_note_slots():
        plan = schedule()
        written[:] = [s.seq.block_table[s.start // bs] * bs + s.start % bs for s in plan.scheduled]
        return plan

    def checked_step():
        before, seen = pool_slots(engine), len(replays.log)
        out = step()
        if len(replays.log) > seen and replays.log[-1][0] < replays.log[-1][1]:
            after = pool_slots(engine)
            changed = set(
                (after != before).any(dim=3).any(dim=1).any(dim=0).nonzero()[:, 0].tolist()
            )
            assert changed <= set(written) | scratch
            assert set(written) <= changed  # the live rows did write their KV
            padded.append(replays.log[-1])
        return out

    engine.scheduler.schedule, engine.step = schedule_and_note_slots, checked_step
    workload(engine)
    assert padded, "no padded replay happened"
    assert pool_slots(engine)[:, :, sorted(scratch)].abs().sum() > 0  # the padding wrote there


def test_padding_rows_write_only_the_scratch_block(model_dir, make_engine):
    engine = make_engine(model_dir("llama-gqa"), **SETTINGS)
    check_padding_stays_in_scratch(engine, on_the_cpu_with_graphs(engine))


def test_the_host_sync_check_sees_syncs():
    x = torch.tensor([0.0, 1.0, 2.0])
    assert dispatched(lambda: x.nonzero()) & HOST_SYNCS == {"aten.nonzero"}
    assert dispatched(lambda: x[x > 0]) & HOST_SYNCS == {"aten.index[bool]"}
    assert dispatched(lambda: x.max().item()) & HOST_SYNCS == {"aten._local_scalar_dense"}
    i = torch.tensor([0, 2])
    assert not dispatched(lambda: x[i].sum()) & HOST_SYNCS  # a gather by index does not sync


# The architectures whose forward differs on the device (tied head, sliding window, q/k norm
# and bias); the others differ in host-side tables or config only (~3 s each under the
# interpreter).
@pytest.mark.parametrize("arch", ["llama-tied", "mistral", "qwen2", "qwen3"])
def test_a_captured_decode_step_never_waits_on_the_device(arch, model_dir, make_engine):
    """Every bucket's step, as `capture_decode_graphs` hands it to a capture, runs the GPU's
    path (fused Triton kernels, plain GEMMs) and nothing in HOST_SYNCS."""
    engine = make_engine(model_dir(arch), packed_weights=False, **SETTINGS)
    runner, seen = engine.runner, []

    def checked(step):
        step()  # the warm-up a capture runs first
        seen.append(dispatched(step))
        return step

    runner.varlen_attention = TritonAttention(runner.sliding_window)
    capture_decode_graphs(
        runner.model,
        engine.kv_cache,
        runner.varlen_attention,
        MAX_SEQS,
        engine.max_model_len,
        engine.device,
        capture=checked,
    )
    assert len(seen) == len(capture_sizes(MAX_SEQS))
    for ops in seen:
        assert {"triton.paged_attention", "triton.rope_store", "aten.linear"} <= ops, ops
        assert not ops & HOST_SYNCS, ops & HOST_SYNCS


def test_no_engine_step_on_the_gpu_path_waits_on_the_device(model_dir, make_engine):
    """Beyond the captured decode: every step of the GPU's path (chunked prefill, a prefix-cache
    hit, greedy, sampled, penalised rows, logprobs) dispatches nothing in HOST_SYNCS; the one
    readback a step needs, its tokens, is a `tolist` (not dispatched)."""
    engine = make_engine(model_dir("qwen3"), packed_weights=False, **SETTINGS)
    engine.runner.varlen_attention = TritonAttention(engine.runner.sliding_window)
    shared = prompt(20, seed=7)
    sampled = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3, max_tokens=4)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2, max_tokens=3)
    requests = [
        Request("greedy", shared, greedy(4)),
        Request("sampled", prompt(30, seed=8), sampled),
        Request("penalised", prompt(5, seed=9), penalised),
    ]
    for r in requests:
        engine.add_request(r)
    steps, results = [], {}

    def step() -> None:
        step_into(engine, results)

    while engine.has_work():
        steps.append(dispatched(step))
    engine.add_request(Request("cached", shared + prompt(3, seed=10), greedy(2)))
    while engine.has_work():
        steps.append(dispatched(step))
    assert results["cached"].num_cached_tokens == 16  # the shared prompt's first block
    assert results["penalised"].finish_reason is not None
    assert sum("triton.paged_attention" in ops for ops in steps) >= 6
    assert all(not ops & HOST_SYNCS for ops in steps), [ops & HOST_SYNCS for ops in steps]
    assert any("aten.searchsorted" in ops for ops in steps)  # the sampled row was drawn


# -- real CUDA graphs ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_cuda_graph_decode_gives_the_eager_tokens(arch, dtype, model_dir, make_engine):
    """Exact in fp32. In bf16, a padded replay runs its GEMMs at the bucket's row count, which
    may round differently from the eager step's, so the graph's run, equal to the eager one or
    not, must be greedy up to bf16 rounding (test_engine_bf16.py's teacher-forced check)."""
    path = model_dir(arch)
    kw = dict(SETTINGS, device="cuda", dtype=dtype, num_blocks=64)  # not sized from memory
    graphed = make_engine(path, **kw)
    eager = make_engine(path, cuda_graphs=False, **kw)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    replays = watch(graphed)
    got, want = workload(graphed), workload(eager)
    assert any(n < bucket for n, bucket in replays.log)
    for rid, ids in prompts_of().items():
        tokens = got[rid].token_ids
        assert len(tokens) == len(want[rid].token_ids), rid
        if dtype == "float32":
            assert tokens == want[rid].token_ids, rid
        else:
            assert_argmax_up_to_rounding(path, "cuda", ids, tokens)


@pytest.mark.gpu
def test_cuda_graph_padding_rows_write_only_the_scratch_block(model_dir, make_engine):
    engine = make_engine(model_dir("llama-gqa"), device="cuda", num_blocks=64, **SETTINGS)
    check_padding_stays_in_scratch(engine, watch(engine))


def test_tp2_ranks_replay_the_same_decode_graphs_and_give_transformers_tokens(model_dir, hf):
    """At TP 2 every rank captures the same buckets (`tp_replica.capture_graphs`) and each
    decides from the step message whether to replay: the follower replays exactly the steps
    rank 0 replays, and the tokens are transformers'."""
    from cluster.engine.tp_replica import TPReplica
    from tests.conftest import engine_config

    path = model_dir("llama-gqa")
    config = engine_config(path, **SETTINGS)
    requests = [  # finishing at different steps: batches of 3, 2 and 1 (padded to 4, 2, 1)
        Request("long", prompt(40, seed=1), greedy(8)),
        Request("cross", prompt(14, seed=2), greedy(5)),  # positions 14..18: a second block
        Request("brief", prompt(1, seed=3), greedy(3)),
    ]
    with TPReplica(config, 2, graph_capture=replay_by_calling) as replica:
        engine = replica.engine
        replays = watch(engine)
        outs = engine.generate(requests)
        assert engine.stats().kv_blocks_used == 0
    assert {bucket for _, bucket in replays.log} == {1, 2, 4}
    assert any(n < bucket for n, bucket in replays.log)  # some were padded
    steps, replayed = replica.tallies[1]
    assert replayed == len(replays.log) and steps > replayed  # prefill steps ran eagerly
    for r, out in zip(requests, outs, strict=True):
        hf.assert_greedy(path, r.prompt_token_ids, out.token_ids, len(out.token_ids))
        assert out.finish_reason == "length"
