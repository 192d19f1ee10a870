"""A hub model's app on real Ray Serve: an engine replica whose start is slow (a download, here
stood in for by `hub_probe.SlowStartWorker`) is listed by `GetStats` with state "loading" while
the router already answers, then "ready"; the replica got the builder's `HF_TOKEN` and
`HF_HUB_OFFLINE` through its runtime env (set in this process after the session's Ray
started, so from nowhere else), loaded the model from its node's cache, and generates."""

from __future__ import annotations

import time
from dataclasses import replace

import grpc
import pytest

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.serving.app import compose_app
from tests.cluster.model.hub_cache import REPO_ID, hub_env, make_hub_cache, use_hub_cache
from tests.e2e.hub_probe import digest
from tests.ray_fixtures import app_metadata, small_app_config, stub

pytestmark = pytest.mark.slow
APP = "hubload"
TOKEN = "hf_pdserveE2eTokenNotReal"


def _with_node_env(app, env: dict[str, str]):
    """`app` with `env` added to every deployment's env vars: what each node's own `ray
    start` environment would give its replicas (here, where the test's cache is)."""
    d = app._bound_deployment
    args = [_with_node_env(a, env) if hasattr(a, "_bound_deployment") else a for a in d.init_args]
    options = dict(d.ray_actor_options)
    runtime_env = dict(options["runtime_env"])
    runtime_env["env_vars"] = {**runtime_env["env_vars"], **env}
    options["runtime_env"] = runtime_env
    return d.options(ray_actor_options=options).bind(*args, **d.init_kwargs)


def test_a_slow_starting_replica_is_listed_loading_then_ready(ray_serve, tmp_path, monkeypatch):
    from ray import serve

    home = tmp_path / "hf"
    make_hub_cache(home / "hub")
    use_hub_cache(monkeypatch, home, offline=True)  # the builder: this process
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    config = replace(small_app_config(REPO_ID, mode="colocated"), name=APP)
    app = compose_app(config, {"Colocated": "tests.e2e.hub_probe:SlowStartWorker"})
    node = {k: v for k, v in hub_env(home).items() if k != "HF_HUB_OFFLINE"}
    serve._run(_with_node_env(app, node), name=APP, route_prefix=f"/{APP}", _blocking=False)
    try:
        s, seen = stub(ray_serve), []
        deadline = time.monotonic() + 180
        while not seen or seen[-1] != "ready":
            assert time.monotonic() < deadline, f"states seen: {seen}"
            try:
                stats = s.GetStats(pb.GetStatsRequest(), metadata=app_metadata(APP), timeout=10)
            except grpc.RpcError:  # the router is not up yet
                time.sleep(0.5)
                continue
            states = [r.state for r in stats.replicas if r.pool == "colocated"]
            if states and (not seen or seen[-1] != states[0]):
                seen.append(states[0])
            time.sleep(0.3)
        assert seen == ["loading", "ready"], seen
        env = serve.get_deployment_handle("Colocated", APP).hub_env.remote().result()
        assert env == {"HF_TOKEN": digest(TOKEN), "HF_HUB_OFFLINE": "1"}
        request = pb.GenerateRequest(
            prompt_token_ids=list(range(40, 52)),
            sampling=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
        tokens = [
            t
            for m in s.Generate(request, metadata=app_metadata(APP), timeout=60)
            for t in m.token_ids
        ]
        assert len(tokens) == 4
    finally:
        serve.delete(APP)
