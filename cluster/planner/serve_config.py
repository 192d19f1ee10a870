"""The Serve config file (`pdserve serve --config FILE`, `serve run FILE`) of a planned shape.

From a base config (a parsed Serve config file): the same file with each pdserve
application's `mode`, pool sizes and `tensor_parallel_size` set to the shape (a pool's
`autoscaling` is dropped: the plan is a fixed size). Without one: a config for one machine
in the style of `deploy/serve/local-cpu.yaml`, each engine pool with the engine limits the
plan assumed.
"""

from __future__ import annotations

import copy
from typing import Any

from cluster.planner.profile import EngineLimits
from cluster.planner.simulator import ClusterShape

BUILDER_PATH = "cluster.serving.app:build_app"


def _pool(replicas: int, tp: int, limits: EngineLimits) -> dict[str, Any]:
    return {
        "replicas": replicas,
        "tensor_parallel_size": tp,
        "cache": {"block_size": limits.block_size, "num_blocks": limits.num_kv_blocks},
        "scheduler": {
            "max_num_seqs": limits.max_num_seqs,
            "max_num_batched_tokens": limits.max_num_batched_tokens,
        },
    }


def serve_config(
    shape: ClusterShape,
    limits: EngineLimits,
    transport: str | None = None,
    model: str | None = None,
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Serve config deploying `shape`; `model` (a checkpoint dir or hub id) when given,
    else the base's or the embedded tiny model."""
    if base is not None:
        return _resized(base, shape, model)
    prefill = shape.prefill_limits or limits
    decode = shape.decode_limits or limits
    args: dict[str, Any] = {"name": "pdserve", "mode": shape.mode}
    if model:
        args["model"] = {"path": model}
    if shape.mode == "disaggregated":
        args["prefill"] = _pool(shape.prefill_replicas, shape.prefill_tp, prefill)
        args["transfer"] = {"transport": transport or "auto"}
    args["decode"] = _pool(shape.decode_replicas, shape.decode_tp, decode)
    args["prefill" if shape.mode == "disaggregated" else "decode"]["prefix_affinity"] = (
        shape.prefix_affinity
    )
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "grpc_options": {
            "port": 9000,
            "grpc_servicer_functions": ["router.grpc_ingress.add_generation_servicer"],
        },
        "applications": [
            {"name": "pdserve", "route_prefix": "/", "import_path": BUILDER_PATH, "args": args}
        ],
    }


def _resized(base: dict[str, Any], shape: ClusterShape, model: str | None) -> dict[str, Any]:
    out = copy.deepcopy(base)
    apps = [a for a in out.get("applications") or [] if a.get("import_path") == BUILDER_PATH]
    if not apps:
        raise ValueError(f"the base config has no application built by {BUILDER_PATH}")
    for app in apps:
        args = app.setdefault("args", {})
        args["mode"] = shape.mode
        if model:
            args["model"] = {**(args.get("model") or {}), "path": model}
        sizes = {"decode": (shape.decode_replicas, shape.decode_tp)}
        if shape.mode == "disaggregated":
            sizes["prefill"] = (shape.prefill_replicas, shape.prefill_tp)
        for pool, (n, tp) in sizes.items():
            section = args.setdefault(pool, {})
            section.pop("autoscaling", None)
            section["replicas"], section["tensor_parallel_size"] = n, tp
    return out
