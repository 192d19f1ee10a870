"""The hand-written H100 profile (`cluster/planner/profiles/h100-llama3.1-8b-v1.json`) holds
exactly what docs/planner.md derives from the published figures it cites, so the documented
64-replica plan is reproducible from the doc alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.planner.profile import Profile

PROFILES = Path(__file__).resolve().parents[3] / "cluster" / "planner" / "profiles"

PARAMS = 8.03e9
WEIGHT_BYTES = 16.06e9  # bf16
HBM = 3.35e12  # bytes/s, H100 SXM
BF16_DENSE = 989e12  # FLOP/s
BANDWIDTH_SHARE = 0.77
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bytes


def test_the_h100_profile_is_the_docs_derivation_of_the_published_figures():
    profile = Profile.load(PROFILES / "h100-llama3.1-8b-v1.json")
    decode_rate = BANDWIDTH_SHARE * HBM
    assert profile.decode.base_s == pytest.approx(WEIGHT_BYTES / decode_rate, rel=1e-3)
    assert profile.decode.per_seq_s == pytest.approx(2 * PARAMS / (0.5 * BF16_DENSE), rel=1e-3)
    assert profile.decode.per_context_s == pytest.approx(KV_BYTES_PER_TOKEN / decode_rate, rel=1e-3)
    assert profile.prefill.per_token_s == pytest.approx(2 * PARAMS / (0.6 * BF16_DENSE), rel=1e-3)
    attended = 4 * 32 * 32 * 128 / (0.4 * BF16_DENSE)
    assert profile.prefill.per_attended_s == pytest.approx(attended, rel=1e-3)
    (kv,) = profile.kv_transfer
    assert (kv.transport, kv.bytes_per_token) == ("nixl", KV_BYTES_PER_TOKEN)
    assert kv.bandwidth_bytes_per_s == pytest.approx(0.7 * 3200e9 / 8 / 8)
    blocks = int(54e9 / KV_BYTES_PER_TOKEN / profile.limits.block_size)
    assert profile.limits.num_kv_blocks == blocks
    assert "NOT measured" in profile.source["method"]


@pytest.mark.parametrize("name", sorted(p.name for p in PROFILES.glob("*.json")))
def test_every_shipped_profile_loads(name):
    profile = Profile.load(PROFILES / name)
    assert profile.step_time(0, 0, 1, 0) > 0
