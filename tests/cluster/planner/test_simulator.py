"""The simulator against closed forms: an M/D/1 queue, one decode batch, the KV capacity and
`max_num_seqs` bounds, a colocated step mixing both phases; and a run is the same for a seed."""

from __future__ import annotations

import math
import time

import pytest

from cluster.client.workload import TraceScale, load_trace
from cluster.planner.profile import (
    DecodeStepModel,
    EngineLimits,
    KVTransferModel,
    Overheads,
    PrefillStepModel,
    Profile,
)
from cluster.planner.sim_workload import RequestClass, SimRequest, mix_requests, trace_requests
from cluster.planner.simulator import ClusterShape, ScaleEvent, Simulator


def profile(prefill=(0.01, 0.0, 0.0), decode=(0.005, 0.0, 0.0), kv=(0.003, 1e9, 1000), **limits):
    return Profile(
        PrefillStepModel(*prefill),
        DecodeStepModel(*decode),
        (KVTransferModel("grpc", *kv),),
        Overheads(0.0, 0.0),
        EngineLimits(**limits),
    )


def test_one_prefill_replica_is_an_md1_queue():
    service = 0.01
    rho = 0.7
    p = profile(prefill=(service, 0.0, 0.0), max_num_seqs=1)
    waits = []
    for seed in range(4):  # 4 x 30,000 requests: the sample mean within about 1 %
        reqs = mix_requests([RequestClass(32, 1)], 30_000, rho / service, 16, seed=seed)
        result = Simulator(p, ClusterShape(prefill_replicas=1, decode_replicas=1)).run(reqs)
        assert all(o.finished for o in result.outcomes)
        assert result.outcomes[7].phases()["prefill"] == pytest.approx(service)
        waits += [o.phases()["queue"] for o in result.outcomes]
    expected = rho * service / (2 * (1 - rho))
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.03)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_one_decode_batch_steps_at_the_batch_step_time(mode):
    batch, prompt, out = 6, 40, 12
    p = profile(prefill=(0.02, 1e-4, 1e-7), decode=(0.004, 3e-4, 2e-6), kv=(0.003, 1e6, 1000))
    reqs = [SimRequest(0.0, prompt, out) for _ in range(batch)]
    shape = ClusterShape(mode=mode, prefill_replicas=1, decode_replicas=1)
    result = Simulator(p, shape).run(reqs)
    first = p.prefill.time(batch * prompt, batch * (prompt * (prompt + 1) // 2))
    kv = p.transfer().time(prompt) if mode == "disaggregated" else 0.0
    # decode step k (k = 1..out-1): every sequence holds prompt + k tokens
    steps = [p.decode.time(batch, batch * (prompt + k)) for k in range(1, out)]
    for o in result.outcomes:
        assert o.ttft_s == pytest.approx(first)
        assert o.itl_s == pytest.approx([kv + steps[0], *steps[1:]])
        assert o.e2e_s == pytest.approx(o.ttft_s + kv + sum(steps))
    flat = profile(decode=(0.004, 3e-4, 0.0))
    one = Simulator(flat, ClusterShape(mode="colocated")).run(reqs).outcomes[0]
    itl = flat.decode.time(batch, 0)
    assert one.itl_s == pytest.approx([itl] * (out - 1))
    assert one.e2e_s == pytest.approx(one.ttft_s + (out - 1) * itl)


@pytest.mark.parametrize("bound", ["kv_blocks", "max_num_seqs"])
def test_decode_capacity_bounds_the_batch(bound):
    # 63-token prompts and their first token fill 4 blocks; one decode step ends each request
    limits = {"num_kv_blocks": 12} if bound == "kv_blocks" else {"max_num_seqs": 3}
    p = profile(**limits)
    reqs = [SimRequest(0.0, 63, 2) for _ in range(6)]
    shape = ClusterShape(prefill_limits=EngineLimits(max_num_seqs=8, num_kv_blocks=64))
    out = Simulator(p, shape).run(reqs).outcomes
    starts = sorted(o.kv_start_s for o in out)
    assert starts[0] == starts[2] < starts[3] == starts[5]
    step = p.decode.time(3, 3 * 64)
    assert starts[3] - starts[0] == pytest.approx(p.transfer().time(63) + step)
    assert all(o.finished for o in out)


def test_a_colocated_step_mixes_a_prefill_into_running_decodes():
    p = profile(prefill=(0.01, 1e-4, 0.0), decode=(0.005, 1e-3, 0.0))
    reqs = [SimRequest(0.0, 16, 10), SimRequest(0.02, 16, 4)]
    a, b = Simulator(p, ClusterShape(mode="colocated")).run(reqs).outcomes
    prefill, decode = p.prefill.time(16, 0), p.decode.time(1, 0)
    mixed = p.step_time(16, 0, 1, 0)
    assert mixed == pytest.approx(0.01 + 16e-4 + 1e-3)
    # B arrives during A's second decode step and is prefilled in the next, beside A
    steps_before = math.ceil((0.02 - prefill) / decode)
    b_start = prefill + steps_before * decode
    assert b.phases()["queue"] == pytest.approx(b_start - 0.02)
    assert b.ttft_s == pytest.approx(b_start + mixed - 0.02)
    assert a.itl_s[steps_before] == pytest.approx(mixed)
    assert a.itl_s[0] == pytest.approx(decode)


def test_prefix_cache_hits_and_a_run_is_the_same_for_a_seed():
    entries = load_trace("mooncake", limit=300)
    reqs = trace_requests(entries, TraceScale(length=1 / 32, time=4.0), 16)
    p = profile(prefill=(0.005, 2e-5, 1e-8), decode=(0.003, 1e-4, 1e-8), num_kv_blocks=4096)
    shape = ClusterShape(prefill_replicas=2, decode_replicas=2)
    a = Simulator(p, shape, seed=7).run(reqs)
    b = Simulator(p, shape, seed=7).run(reqs)
    assert [o.token_times for o in a.outcomes] == [o.token_times for o in b.outcomes]
    assert sum(o.cached_tokens for o in a.outcomes) > 0
    # without affinity a prompt's start is cached on one replica in two, on average
    off = ClusterShape(prefill_replicas=2, decode_replicas=2, prefix_affinity=False)
    c = Simulator(p, off, seed=7).run(reqs)
    assert sum(o.cached_tokens for o in c.outcomes) < sum(o.cached_tokens for o in a.outcomes)


def test_a_replica_added_takes_calls_after_its_startup_delay():
    p = profile(prefill=(0.05, 0.0, 0.0), max_num_seqs=1)
    reqs = mix_requests([RequestClass(32, 1)], 200, 40.0, 16, seed=1)
    events = (ScaleEvent(1.0, "prefill", 2),)
    shape = ClusterShape(prefill_replicas=1, scale_events=events, startup_s=0.5)
    out = Simulator(p, shape).run(reqs).outcomes
    second = [o for o in out if o.prefill_replica == "prefill-1"]
    assert second and min(o.enqueued_s for o in second) >= 1.5


def test_a_1000_request_trace_on_64_replicas(capsys):
    """Not a timing assertion (a shared CI machine): the run finishes every request and says
    how long it took."""
    reqs = trace_requests(load_trace("mooncake", limit=1000), TraceScale(1.0, 1 / 16), 16)
    p = profile(
        prefill=(0.01, 2e-5, 1e-9), decode=(0.008, 1e-4, 5e-8), kv=(0.002, 20e9, 131072),
        max_num_seqs=256, max_num_batched_tokens=8192, num_kv_blocks=40960,
    )  # fmt: skip
    start = time.perf_counter()
    result = Simulator(p, ClusterShape(prefill_replicas=16, decode_replicas=48)).run(reqs)
    elapsed = time.perf_counter() - start
    assert result.summary().completed == 1000
    with capsys.disabled():
        print(f"\n1000-request Mooncake trace on 16P:48D simulated in {elapsed:.1f} s")
