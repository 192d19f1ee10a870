"""`pdserve serve --prefill-replicas 2 --decode-replicas 2` on this (2-core) machine, with the
model named by hub id from a cache the test made (HF_HUB_OFFLINE): it comes up, or ends with
the message naming the pool, what it needs and what the cluster has, within 60 s; it never
hangs. The command starts its own local Ray, so it runs in a child process, away from the
session's Ray (tests/ray_fixtures.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.cluster.model.hub_cache import REPO_ID, hub_env, make_hub_cache
from tests.ray_fixtures import free_port

pytestmark = pytest.mark.slow
LIMIT_S = 60


def test_two_by_two_on_a_small_machine_starts_or_fails_naming_the_pool(tmp_path):
    make_hub_cache(tmp_path / "hf" / "hub")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(hub_env(tmp_path / "hf", offline=True))
    command = [
        sys.executable, "-m", "cluster.cli.main", "serve", "--model", REPO_ID,
        "--prefill-replicas", "2", "--decode-replicas", "2", "--torch-threads", "1",
        "--grpc-port", str(free_port()), "--http-port", str(free_port()),
        # The wait for the replicas leaves room for starting Ray before it (~12 s on a slow
        # day) and stopping it after.
        "--startup-timeout", str(LIMIT_S - 30), "--demo", "--exit",
    ]  # fmt: skip
    began = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LIMIT_S)
    took = time.monotonic() - began
    if done.returncode == 0:
        assert "pdserve is up." in done.stdout, done.stdout
        assert "-> '" in done.stdout  # the demo request got its tokens back
    else:  # the one way it may fail: not placed in time, named
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 2 and last.startswith("error (RESOURCE_EXHAUSTED)"), last
        assert "pool " in last and "the cluster has" in last, last
    assert took < LIMIT_S
