"""The hand-written H100 profile (`cluster/planner/profiles/h100-llama3.1-8b-v1.json`) holds
exactly what docs/planner.md derives from the published figures it cites (TP 1, and TP 2 and
4 with the stated all-reduce model), so the documented plans are reproducible from the doc
alone; version 1 profiles still load; profiles of two sizes merge."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.planner.profile import PROFILE_VERSION, Profile

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


NVLINK = 450e9  # bytes/s a direction, H100 SXM NVLink 4 (900 GB/s both ways)
NVLINK_SHARE = 0.7
ALL_REDUCE_LATENCY = 10e-6  # assumed
ACTIVATION_BYTES = 4096 * 2  # hidden size x bf16, one token
ALL_REDUCES = 2 * 32  # two a layer


@pytest.mark.parametrize("k", [2, 4])
def test_the_h100_profiles_tp_sizes_are_the_docs_derivation(k):
    tp1 = Profile.load(PROFILES / "h100-llama3.1-8b-v1.json")
    profile = tp1.at_tp(k)
    decode_rate = BANDWIDTH_SHARE * HBM
    # a ring all-reduce sends 2 (k - 1) / k of the activations from each GPU
    per_token = ALL_REDUCES * 2 * (k - 1) / k * ACTIVATION_BYTES / (NVLINK_SHARE * NVLINK)
    latency = ALL_REDUCES * ALL_REDUCE_LATENCY
    assert profile.decode.base_s == pytest.approx(WEIGHT_BYTES / k / decode_rate + latency)
    seq = 2 * PARAMS / (0.5 * BF16_DENSE) / k + per_token
    assert profile.decode.per_seq_s == pytest.approx(seq, rel=1e-6)
    context = KV_BYTES_PER_TOKEN / k / decode_rate
    assert profile.decode.per_context_s == pytest.approx(context, rel=1e-6)
    assert profile.prefill.base_s == pytest.approx(tp1.prefill.base_s + latency)
    token = 2 * PARAMS / (0.6 * BF16_DENSE) / k + per_token
    assert profile.prefill.per_token_s == pytest.approx(token, rel=1e-6)
    attended = 4 * 32 * 32 * 128 / (0.4 * BF16_DENSE) / k
    assert profile.prefill.per_attended_s == pytest.approx(attended, rel=1e-6)
    assert profile.limits.num_kv_blocks == k * tp1.limits.num_kv_blocks
    assert replace(profile.limits, num_kv_blocks=1) == replace(tp1.limits, num_kv_blocks=1)
    assert profile.kv_transfer == tp1.kv_transfer  # the same bytes move
    assert tp1.tp_sizes() == (1, 2, 4)


def test_a_version_1_profile_loads_as_tp1_and_saves_as_version_2(tmp_path):
    raw = json.loads((PROFILES / "cpu-small-v1.json").read_text())
    assert raw["version"] == 1 and "tensor_parallel" not in raw
    profile = Profile.from_json(raw)
    assert profile.tp_sizes() == (1,) and profile.at_tp(1) == profile
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["version"] == PROFILE_VERSION == 2
    assert (again.prefill, again.decode, again.limits) == (
        profile.prefill,
        profile.decode,
        profile.limits,
    )
    with pytest.raises(ValueError, match="no models for TP 2"):
        profile.at_tp(2)
    with pytest.raises(ValueError, match="version 3"):
        Profile.from_json({**raw, "version": 3})


def test_profiles_of_two_sizes_merge_through_the_cli(tmp_path, capsys):
    from cluster.cli.main import main

    h100 = Profile.load(PROFILES / "h100-llama3.1-8b-v1.json")
    one, two = h100.at_tp(1), h100.at_tp(2)
    probed = [replace(one, tensor_parallel=()), replace(two, tensor_parallel=())]
    for p, name in zip(probed, ("tp1.json", "tp2.json"), strict=True):
        p.save(tmp_path / name)
    out = tmp_path / "merged.json"
    argv = ["profile", "--merge", str(tmp_path / "tp2.json"), str(tmp_path / "tp1.json")]
    assert main([*argv, "--out", str(out)]) == 0
    merged = Profile.load(out)
    assert merged.tensor_parallel_size == 1 and merged.tp_sizes() == (1, 2)
    assert merged.at_tp(2).decode == h100.at_tp(2).decode
    assert merged.at_tp(1).prefill == h100.prefill
    assert main([*argv, str(tmp_path / "tp1.json"), "--out", str(out)]) == 2
    assert "sizes repeat" in capsys.readouterr().err
