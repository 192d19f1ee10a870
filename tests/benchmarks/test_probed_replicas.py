"""The benchmark-only replicas: the production role classes plus timing probes, deployed in
their place through `compose_app`, and a real replica's `time_decode`."""

from __future__ import annotations

import importlib

import pytest

from benchmarks.grpc_calls import stub, wait_ready
from benchmarks.probed_replicas import PROBED_ROLES, EngineProbes
from benchmarks.serve_session import delete, deploy
from cluster.model.make_model import cached_model
from cluster.serving.app import ROLE_CLASSES, compose_app
from tests.ray_fixtures import small_app_config

PROBES = ("time_decode", "engine_thread_id", "engine_cpu")


def _cls(import_path: str) -> type:
    module, _, name = import_path.partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("role", sorted(PROBED_ROLES))
def test_a_probed_role_is_its_production_class_plus_the_probes(role: str) -> None:
    production, probed = _cls(ROLE_CLASSES[role]), _cls(PROBED_ROLES[role])
    assert issubclass(probed, production) and issubclass(probed, EngineProbes)
    for probe in PROBES:
        assert hasattr(probed, probe) and not hasattr(production, probe), probe


def test_compose_app_refuses_a_role_it_does_not_have() -> None:
    config = small_app_config(str(cached_model("tiny")))
    with pytest.raises(ValueError, match="Nope"):
        compose_app(config, {"Nope": "benchmarks.probed_replicas:ProbedDecodeWorker"})


def test_a_replica_times_its_engine_alone_and_refuses_when_busy_or_asked_wrong(ray_serve):
    """`time_decode` on a real replica: its numbers, its refusals, and nothing left behind."""
    from dataclasses import replace

    from ray import serve

    from cluster.errors import InvalidArgument, Unavailable
    from cluster.pb.pdserve.v1 import generation_pb2 as pb
    from tests.ray_fixtures import wait_for_idle

    prompt = list(range(20, 36))
    config = small_app_config(str(cached_model("tiny")), mode="colocated")
    deploy(replace(config, name="timed"), PROBED_ROLES)
    try:
        handle = serve.get_deployment_handle("Colocated", app_name="timed")
        wall, cpu = handle.time_decode.remote(prompt, 8).result()
        assert 0 < wall < 5 and 0 < cpu < 5
        with pytest.raises(InvalidArgument, match="max_tokens"):
            handle.time_decode.remote([20, 21], 2).result()
        with pytest.raises(InvalidArgument):  # the engine's own prompt check
            handle.time_decode.remote([], 8).result()
        assert handle.engine_thread_id.remote().result() > 0
        total, in_step = handle.engine_cpu.remote().result()
        assert total > 0 and 0 <= in_step <= total  # time_decode steps as a command
        # Busy: a request streaming through the app holds the engine while time_decode asks.
        proxy = stub(ray_serve.grpc_port)
        wait_ready(proxy, "timed", prompt)
        sampling = pb.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
        stream = proxy.Generate(request, metadata=(("application", "timed"),))
        next(stream)
        with pytest.raises(Unavailable, match="idle"):
            handle.time_decode.remote(prompt, 8).result()
        stream.cancel()
        wait_for_idle(ray_serve, "timed", {"colocated"})
    finally:
        delete("timed")
