"""`fit_profile` (the pure half of `pdserve profile`) turns probe records, as the load
generator records them, into the profile whose step times made them."""

from __future__ import annotations

import pytest

from cluster.client.load_generator import PhaseTiming, RequestRecord
from cluster.planner.probe import PREFILL_OUTPUT, ProbePlan, ProbeRecords, fit_profile
from cluster.planner.profile import EngineLimits, Profile
from cluster.planner.step_fit import prefill_features

LIMITS = EngineLimits(16, 512, 1024, 16)
PREFILL = (0.02, 1e-4, 2e-8)
DECODE = (0.01, 2e-3, 1e-6)
KV = (0.004, 2e-6)  # fixed, per token
ROUTING, PROXY = 0.003, 0.002


def prefill_record(i: int, n: int) -> RequestRecord:
    steps, tokens, attended = prefill_features(n, 0, LIMITS.max_num_batched_tokens)
    prefill = PREFILL[0] * steps + PREFILL[1] * tokens + PREFILL[2] * attended
    kv = KV[0] + KV[1] * n
    ttft = ROUTING + prefill
    total = ttft + kv + 0.01
    r = RequestRecord(i, 0.0, n, PREFILL_OUTPUT, sent_s=0.0)
    r.token_times = [ttft + PROXY / 2, total + PROXY]
    r.timing = PhaseTiming(0.0, prefill, kv, ttft, total - ttft, total, "p", "d")
    return r


def decode_group(batch: int, prompt: int, out: int, replicas: int = 1) -> list[RequestRecord]:
    """`batch` requests sent together, spread over `replicas` decode replicas."""
    records = []
    for k in range(replicas):
        share = batch // replicas + (k < batch % replicas)
        records += decode_batch(share, prompt, out, f"d{k}")
    return records


def decode_batch(batch: int, prompt: int, out: int, replica: str) -> list[RequestRecord]:
    context = batch * (prompt + 1 + out / 2)
    step = DECODE[0] + DECODE[1] * batch + DECODE[2] * context
    records = []
    for i in range(batch):
        r = RequestRecord(i, 0.0, prompt, out, sent_s=0.0)
        r.token_times = [0.1 + i * 0.01, 0.3 + i * 0.01] + [
            0.3 + i * 0.01 + k * step for k in range(1, out - 1)
        ]
        r.timing = PhaseTiming(0.0, 0.05, 0.01, 0.1, 0.2, 0.3, "p", replica)
        records.append(r)
    return records


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_fitted_profile_reproduces_the_probed_step_times(tmp_path, replicas):
    plan = ProbePlan.design(2048, LIMITS, repeats=1, decode_output=32)
    assert plan.prefill_lengths[0] == 16 and max(plan.prefill_lengths) == 1536
    assert plan.decode_batches == (1, 2, 4, 8, 16)
    assert plan.decode_prompts == (16, 768)
    # the largest batch's prompts and outputs fit one replica's pool: 16 x (223 + 33) tokens
    small = ProbePlan.design(2048, EngineLimits(16, 512, 256, 16), decode_output=32)
    assert small.decode_prompts == (16, 223)
    records = ProbeRecords(
        [prefill_record(i, n) for i, n in enumerate(plan.prefill_lengths)],
        [
            (b, p, decode_group(b, p, 32, replicas))
            for b in plan.decode_batches
            for p in plan.decode_prompts
        ],
    )
    profile = fit_profile(records, LIMITS, "grpc", 4096, 32, {"machine": "test"})
    assert (
        profile.prefill.base_s,
        profile.prefill.per_token_s,
        profile.prefill.per_attended_s,
    ) == pytest.approx(PREFILL, rel=1e-4)
    assert (
        profile.decode.base_s,
        profile.decode.per_seq_s,
        profile.decode.per_context_s,
    ) == pytest.approx(DECODE, rel=1e-4)
    kv = profile.transfer("grpc")
    assert kv.time(1000) == pytest.approx(KV[0] + KV[1] * 1000, rel=1e-6)
    assert profile.overheads.routing_s == pytest.approx(ROUTING)
    assert profile.overheads.proxy_s == pytest.approx(PROXY)
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile


def test_a_colocated_deployment_cannot_be_profiled():
    records = ProbeRecords([prefill_record(i, n) for i, n in enumerate((16, 64, 256))], [])
    for r in records.prefill:
        r.timing = PhaseTiming(0.0, r.timing.prefill, 0.0, 0.1, 0.1, 0.2, "c", "c")
    with pytest.raises(ValueError, match="disaggregated"):
        fit_profile(records, LIMITS, "grpc", 4096, 32, {})


def test_another_profile_version_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"version": 99}')
    with pytest.raises(ValueError, match="version 99"):
        Profile.load(path)
