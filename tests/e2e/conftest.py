"""The two apps most end-to-end tests share, deployed once per test session on the session's
Serve (tests/ray_fixtures.py): "pd", disaggregated with 2 prefill and 2 decode replicas, and
"co", colocated."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from tests.ray_fixtures import deploy, small_app_config

PD, CO = "pd", "co"
ENGINE_CORE = (max(os.sched_getaffinity(0)),)
PD_LEASE_SECONDS = 4.0


@pytest.fixture(scope="session")
def apps(ray_serve, tokenizer_model_dir):
    from ray import serve

    from cluster.config import TransferConfig

    base = small_app_config(str(tokenizer_model_dir))
    # The disaggregated app runs its engines with output threads, as on a GPU; the colocated
    # one takes the CPU's default (text on the engine thread, after the step).
    two = replace(base.prefill, replicas=2, output_thread=True)
    deploy(
        replace(
            base,
            prefill=two,
            decode=replace(base.decode, replicas=2, output_thread=True),
            transfer=TransferConfig(lease_seconds=PD_LEASE_SECONDS),
        ),
        PD,
        "/pd",
    )
    # The colocated engine runs on its own core (the last one), its replica's other threads
    # wherever Ray put them.
    deploy(
        replace(base, mode="colocated", decode=replace(base.decode, engine_cpus=ENGINE_CORE)),
        CO,
        "/co",
    )
    yield ray_serve
    serve.delete(PD)
    serve.delete(CO)
