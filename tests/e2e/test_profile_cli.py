"""`pdserve profile` against the session's disaggregated "pd" app (tiny model, 512 tokens per
step, 512 KV blocks of 16 tokens per replica), then `pdserve plan` on what it wrote: the probes
finish, the fit is a usable profile of this deployment, and a plan runs on it."""

from __future__ import annotations

from cluster.cli.main import main
from cluster.planner.profile import Profile
from tests.e2e.conftest import PD
from tests.ray_fixtures import wait_for_idle


def test_profile_fits_the_running_app_and_plan_reads_it(apps, tokenizer_model_dir, tmp_path):
    out = tmp_path / "profile.json"
    argv = ["profile", "--target", apps.grpc_target, "--application", PD, "--out", str(out)]
    argv += ["--model", str(tokenizer_model_dir), "--max-num-seqs", "64"]
    assert main([*argv, "--repeats", "1", "--decode-output", "8", "--machine", "ci"]) == 0
    profile = Profile.load(out)
    assert profile.limits.num_kv_blocks == 512 and profile.limits.block_size == 16
    assert profile.limits.max_num_batched_tokens == 512
    assert profile.kv_transfer[0].transport in ("grpc", "nixl")
    assert profile.source["machine"] == "ci" and profile.source["decode_samples"] >= 8
    assert profile.tensor_parallel_size == 1 == profile.source["tensor_parallel_size"]
    # a longer prompt takes longer; a decode step takes time
    assert profile.prefill.time(1024, 1024 * 512) > profile.prefill.time(16, 136)
    assert profile.decode.time(1, 40) > 0
    wait_for_idle(apps, PD, {"prefill", "decode"})
    plan = ["plan", "--profile", str(out), "--mix", "64:16", "--rate", "2", "--num-requests"]
    assert (
        main([*plan, "50", "--replicas", "3", "--slo-ttft-ms", "2000", "--slo-itl-ms", "500"]) == 0
    )
