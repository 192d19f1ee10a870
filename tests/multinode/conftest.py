"""One five-node Ray cluster per test module, on hosts of a `NetnsLab` (tests/multinode/
netns_lab.py), running deploy/serve/production.yaml with only what a CPU needs changed.

Hosts (node types of deploy/aws/cluster.yaml): `head` (head + router), `prefill` and
`prefill2` (prefill_gpu), `decode1` and `decode2` (decode_gpu). Two applications, deployed at
once with `serve deploy` from the head host: "pdserve", the production application (transport
`auto`, which is nixl here), and "pdgrpc", the same on `grpc`. What changes from the
production file: the model (the `tiny` checkpoint the tests build, its weights unpacked),
device and dtype (cpu, float32), sizes (KV blocks, token budget, torch threads, the context of
the tiny model), the GPUs (none), pool sizes (one router, a replica per prefill and per decode
node) and, for the partition test, a shorter `fetch_timeout_seconds`. Everything the lab made
is removed when the module ends, also when it fails; tests/multinode/test_zz_nothing_left.py checks.
"""

from __future__ import annotations

import copy
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.multinode.namespaced_ray import REPO, NamespacedRay
from tests.multinode.netns_lab import NetnsLab, usable

PRODUCTION = REPO / "deploy" / "serve" / "production.yaml"
PD, GRPC = "pdserve", "pdgrpc"
FETCH_TIMEOUT_S = 4.0
NODE_TYPES = {
    "head": ["head", "router"],
    "prefill": ["prefill_gpu"],
    "prefill2": ["prefill_gpu"],
    "decode1": ["decode_gpu"],
    "decode2": ["decode_gpu"],
}
LAB_PREFIXES: list[str] = []  # every lab this process made (test_zz_nothing_left.py)


def _pools(args: dict[str, Any], replicas: dict[str, int]) -> None:
    for pool, n in replicas.items():
        cfg = args[pool]
        cfg["num_gpus"] = 0
        cfg["replicas"] = n
        if cfg.get("autoscaling"):
            cfg["autoscaling"].update(min_replicas=n, initial_replicas=n)
        if pool != "router":
            cfg["torch_threads"] = 1
            cfg["cache"]["num_blocks"] = 512
            cfg["scheduler"]["max_num_batched_tokens"] = 512


def cpu_serve_config(model_dir: Path) -> dict[str, Any]:
    """deploy/serve/production.yaml, changed only where a CPU and the tiny model need it, plus
    the same application on `grpc`."""
    raw = yaml.safe_load(PRODUCTION.read_text())
    app = raw["applications"][0]
    args = app["args"]
    args["model"].update(path=str(model_dir), dtype="float32", device="cpu", max_model_len=2048)
    # Plain fp32 weights: the packed ones' native kernels are built on first use, a wait that
    # has nothing to do with the nodes.
    args["model"]["packed_weights"] = False
    _pools(args, {"router": 1, "prefill": 2, "decode": 2})
    args["transfer"].update(fetch_timeout_seconds=FETCH_TIMEOUT_S, lease_seconds=10)
    other = copy.deepcopy(app)
    other.update(name=GRPC, route_prefix="/grpc")
    other["args"]["name"] = GRPC
    other["args"]["transfer"]["transport"] = "grpc"
    _pools(other["args"], {"router": 1, "prefill": 1, "decode": 1})
    raw["applications"].append(other)
    return raw


@pytest.fixture(scope="module")
def cluster(tokenizer_model_dir, tmp_path_factory) -> Iterator[NamespacedRay]:
    why_not = usable()
    if why_not:
        pytest.skip(f"multi-node tests need network namespaces: {why_not}")
    prefix = f"pm{secrets.token_hex(2)}"
    LAB_PREFIXES.append(prefix)
    lab = NetnsLab(prefix)
    temp = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    began = time.monotonic()
    try:
        lab.create(list(NODE_TYPES))
        ray = NamespacedRay(lab, temp, NODE_TYPES)
        for host in NODE_TYPES:  # one at a time: joins at once overload a busy GCS
            ray.start(host)
        ray.wait_for_nodes(list(NODE_TYPES))
        config = tmp_path_factory.mktemp("serve") / "cpu-production.yaml"
        config.write_text(yaml.safe_dump(cpu_serve_config(tokenizer_model_dir)))
        ray.deploy(config)
        ray.wait_until_running([PD, GRPC])
        print(f"\nmulti-node cluster up in {time.monotonic() - began:.0f} s")
        yield ray
    finally:
        lab.destroy()
        shutil.rmtree(temp, ignore_errors=True)
