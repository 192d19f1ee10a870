"""docs/deployment.md's multi-node commands are the harness's own (tests/multinode/
namespaced_ray.py), less the flags only a lab of Ray nodes on one machine needs."""

from __future__ import annotations

import shlex
from pathlib import Path

from cluster.serving.app import NODE_ENV_VARS
from tests.multinode.conftest import NODE_TYPES
from tests.multinode.namespaced_ray import REPO, NamespacedRay
from tests.multinode.netns_lab import NetnsLab

DOC = REPO / "docs" / "deployment.md"
LAB_ONLY = ("--temp-dir=", "--object-store-memory=")  # one machine's worth of Ray nodes
ADDRESSES = {"head": "10.213.47.2", "prefill": "10.213.47.3", "decode1": "10.213.47.4"}


def _documented() -> list[list[str]]:
    env = " ".join(f"{k}={v}" for k, v in NODE_ENV_VARS.items())
    lines = [line for line in DOC.read_text().splitlines() if line.startswith(f"{env} ray start")]
    return [shlex.split(line)[len(NODE_ENV_VARS) + 2 :] for line in lines]


def _harness(host: str) -> list[str]:
    lab = NetnsLab("doc", hosts=dict(ADDRESSES, decode2="10.213.47.5"))
    command = NamespacedRay(lab, Path("/tmp/doc"), NODE_TYPES).start_command(host)
    assert Path(command[0]).name == "ray" and command[1] == "start"
    return [arg for arg in command[2:] if not arg.startswith(LAB_ONLY)]


def test_the_documented_ray_starts_are_the_harness_commands():
    assert _documented() == [_harness(host) for host in ADDRESSES]


def test_the_documented_serve_deploy_targets_the_harness_dashboard():
    lab = NetnsLab("doc", hosts=dict(ADDRESSES))
    dashboard = NamespacedRay(lab, Path("/tmp/doc"), NODE_TYPES).dashboard
    want = f"serve deploy deploy/serve/production.yaml --address http://{dashboard}"
    assert want in DOC.read_text()
