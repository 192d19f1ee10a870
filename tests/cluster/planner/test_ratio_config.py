"""`autoscaling.ratio_policy`: validated with the project's config error naming the field, the
two pools' Serve policies become `SplitPolicy` fed by one planner, and `SplitPolicy` answers
with the pool's own signals whenever the planner has no decision."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.errors import InvalidArgument
from cluster.planner import split_policy
from cluster.planner.split_decision import SplitDecision
from cluster.planner.split_planner import PlannerState
from cluster.planner.split_policy import SplitPolicy
from cluster.serving.app import deployment_options, ratio_policy
from cluster.serving.app_config import AppConfig
from cluster.serving.autoscaling import POLICY_PATH, RATIO_POLICY_PATH

PROFILE = str(Path(__file__).parents[3] / "cluster/planner/profiles/cpu-small-v1.json")
POOL = {"autoscaling": {"min_replicas": 1, "max_replicas": 2}}
RATIO = {"profile": PROFILE, "total_replicas": 3, "slo_ttft_ms": 3000, "slo_itl_ms": 200}


def config(ratio: dict | None = None, **args) -> AppConfig:
    ratio = {**RATIO, **(ratio or {})}
    d = {"model": {"path": "/m"}, "prefill": POOL, "decode": POOL, **args}
    return AppConfig.from_dict({**d, "autoscaling": {"ratio_policy": ratio}})


def refused(ratio: dict | None = None, **args) -> str:
    with pytest.raises(InvalidArgument) as caught:
        config(ratio, **args)
    return caught.value.message


@pytest.mark.parametrize(
    "ratio, message",
    [
        ({"total_replicas": 5}, "total_replicas is 5: the pools' bounds split 2..4 replicas"),
        ({"total_replicas": 1}, "total_replicas must be >= 2"),
        ({"slo_itl_ms": 0}, "slo_ttft_ms and slo_itl_ms must be > 0"),
        ({"profile": ""}, "profile: the path of a planner profile JSON file"),
        ({"interval_s": 40}, "window_s >= interval_s"),
        ({"sim_requests": 0}, "sim_requests in 1..1000"),
        ({"slo_ttft_ms": "fast"}, "autoscaling.ratio_policy.slo_ttft_ms: expected a number"),
        ({"budget": 3}, "autoscaling.ratio_policy.budget: unknown key"),
    ],
)
def test_bad_values_are_refused_naming_the_field(ratio, message):
    text = refused(ratio)
    assert "autoscaling.ratio_policy" in text and message in text


def test_the_pools_must_autoscale_in_a_disaggregated_app():
    assert "needs prefill.autoscaling and decode.autoscaling" in refused(decode={})
    assert "disaggregated" in refused(mode="colocated")


def test_a_missing_profile_is_refused_when_the_app_is_built(tmp_path):
    c = config({"profile": str(tmp_path / "nope.json")})
    with pytest.raises(InvalidArgument, match="no file"):
        c.autoscaling.ratio_policy.resolved()


def test_both_pools_get_the_split_policy_over_their_own():
    c = config()
    policies = {}
    for name, pool in (("Prefill", "prefill"), ("Decode", "decode")):
        opts = deployment_options(name, c.pool(pool), None, ratio_policy(c, pool))
        policies[pool] = opts["autoscaling_config"]["policy"]
    assert {p["policy_function"] for p in policies.values()} == {RATIO_POLICY_PATH}
    prefill = policies["prefill"]["policy_kwargs"]
    assert prefill["fallback"]["policy_function"] == POLICY_PATH
    assert prefill["planner"] == policies["decode"]["policy_kwargs"]["planner"]  # one planner
    assert prefill["planner"]["prefill_bounds"] == [1, 2]
    assert ratio_policy(AppConfig.from_dict({"model": {"path": "/m"}}), "prefill") is None
    # Serve's policy kwargs must be JSON
    SplitPolicy(**policies["decode"]["policy_kwargs"])


def ctx(prefill_queued: float) -> SimpleNamespace:
    return SimpleNamespace(
        aggregated_metrics={"queued_prompt_tokens": {"r": prefill_queued}},
        total_num_requests=0,
        target_num_replicas=1,
        policy_state={},
    )


def policy(monkeypatch, pool: str = "prefill") -> SplitPolicy:
    c = config()
    kwargs = ratio_policy(c, pool)["policy_kwargs"]
    kwargs["fallback"]["policy_kwargs"] = {"targets": {"queued_prompt_tokens": 100.0}}
    p = SplitPolicy(**kwargs)
    monkeypatch.setattr(p, "_poll", lambda now: None)  # no Ray: the state is set by hand
    return p


def decision(prefill: int, decode: int) -> SplitDecision:
    return SplitDecision(prefill, decode, 900, 2, 1.0, 0.9, 1.0, ((1, 0.5), (2, 0.9)))


def test_policy_follows_a_fresh_decision_else_the_pools_own_signals(monkeypatch):
    p = policy(monkeypatch)
    assert p(ctx(250.0))[0] == 3  # no state: ceil(250 / 100)
    p.state = PlannerState(decision(2, 1), "simulated", time.time())
    assert p(ctx(250.0))[0] == 2
    p.state = PlannerState(None, "3 requests in the last 30 s", time.time())
    assert p(ctx(50.0))[0] == 1
    stale = time.time() - 10 * p.settings.interval_s
    p.state = PlannerState(decision(2, 1), "simulated", stale)
    assert p(ctx(250.0))[0] == 3


def test_policy_without_a_planner_scales_on_its_own(monkeypatch):
    def gone(settings):
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(split_policy, "planner_handle", gone)
    c = config()
    kwargs = ratio_policy(c, "decode")["policy_kwargs"]
    kwargs["fallback"]["policy_kwargs"] = {"targets": {"running": 4.0}}
    p = SplitPolicy(**kwargs)
    load = SimpleNamespace(
        aggregated_metrics={"running": {"a": 6.0, "b": 3.0}},
        total_num_requests=0,
        target_num_replicas=1,
        policy_state={},
    )
    assert p(load)[0] == 3
