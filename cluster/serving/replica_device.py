"""Where an engine replica runs its model: device and dtype "auto" decided in the replica's own
process, on the node Ray placed it on, never by the process that built the app.

"auto" is cuda + bfloat16 when this process may use a GPU, else cpu + float32
(`ModelConfig.on_device`). It may use one when torch sees one and, inside a Ray actor, Ray
granted the actor a GPU: Ray leaves `CUDA_VISIBLE_DEVICES` alone for an actor that asked for
none, so without the second test a replica of a pool with `num_gpus` 0 placed on a GPU node
would take a GPU that other replicas reserved. The same rule decides the pools' GPUs when the
app is built (`gpu_placement`), so the two agree.
"""

from __future__ import annotations

from dataclasses import replace

from cluster.config import EngineConfig


def ray_granted_gpus() -> int | None:
    """How many GPUs Ray granted this process's actor; None outside a Ray actor (a driver, a
    test, a process without Ray), where Ray decides nothing."""
    import ray

    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return None
    return len(context.get_accelerator_ids().get("GPU", []))


def replica_may_use_gpu() -> bool:
    """Whether this process may run its engine on a GPU: torch sees one and, in a Ray actor,
    Ray granted it one (`ray_granted_gpus`)."""
    import torch

    if not torch.cuda.is_available():
        return False
    granted = ray_granted_gpus()
    return granted is None or granted > 0


def on_replica(config: EngineConfig) -> EngineConfig:
    """`config` made concrete here: device and dtype "auto" by `replica_may_use_gpu`, and the
    token budget for that device (`EngineConfig.resolved`)."""
    model = config.model
    if model.device == "auto":
        model = model.on_device(cuda=replica_may_use_gpu())
    return replace(config, model=model).resolved()
