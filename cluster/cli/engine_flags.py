"""`pdserve serve`'s model and engine flags, named as `vllm serve` names them, and the parts of
the `AppConfig` they set: the model (`ModelConfig`) and each engine pool's KV pool, scheduler
and tensor parallel size."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from cluster.config import ConfigError, ModelConfig, byte_size
from cluster.errors import InvalidArgument
from cluster.serving.pool_config import TENSOR_PARALLEL_SIZES, PoolConfig


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face checkpoint directory or hub id (org/name: the local cache first, "
        "downloaded unless HF_HUB_OFFLINE=1) (default: the embedded tiny model)",
    )
    p.add_argument(
        "--revision", default="", help="hub branch, tag or commit of --model (default: main)"
    )
    p.add_argument(
        "--served-model-name",
        default="",
        help="the name clients call the model by (default: the hub id, or the directory's name)",
    )
    add_device_arguments(p)
    p.add_argument(
        "--max-model-len", type=int, default=0, help="context limit; 0 = the checkpoint's"
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every engine step eagerly: no CUDA graphs for decode on a GPU "
        "(model.cuda_graphs: false)",
    )
    p.add_argument("--max-num-seqs", type=int, default=128, help="sequences per engine batch")
    add_parallel_arguments(p)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step (default: 8192 on a GPU, 512 on the CPU)",
    )
    kv = p.add_argument_group("KV cache (sized from memory unless --num-kv-blocks is given)")
    kv.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks per engine (default: sized by the two flags below)",
    )
    kv.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of the GPU's memory one engine may fill; the KV pool gets what the "
        "weights and activations leave of it",
    )
    kv.add_argument(
        "--kv-cache-memory",
        type=_bytes_arg,
        default=0,
        metavar="BYTES",
        help="bytes for each engine's KV pool, e.g. 4GiB; the CPU's way of sizing it (on a GPU "
        "it overrides --gpu-memory-utilization) (default: 0, on the CPU 1024 blocks)",
    )


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """`--tensor-parallel-size` (vLLM's, also `-tp`) for every engine pool, and an override
    per pool (`--prefill-…`, `--decode-…`, as `--prefill-replicas`)."""
    tp = p.add_argument_group("tensor parallelism (a replica's ranks on one node)")
    tp.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        choices=TENSOR_PARALLEL_SIZES,
        help="ranks each engine replica spans; 1, 2 or 4 in disaggregated mode, where the two "
        "pools may differ (default: 1)",
    )
    for pool in ("prefill", "decode"):
        tp.add_argument(
            f"--{pool}-tensor-parallel-size",
            type=int,
            default=None,
            choices=TENSOR_PARALLEL_SIZES,
            help=f"the {pool} pool's (default: --tensor-parallel-size's)",
        )


def add_device_arguments(p: argparse._ActionsContainer) -> None:
    """`--device` and `--dtype`, "auto" by default: `ModelConfig.on_device` decides them (cuda
    and bfloat16 where torch sees a GPU, else cpu and float32), for `serve` and `generate`."""
    p.add_argument(
        "--device",
        default="auto",
        help="torch device: auto (cuda where torch sees a GPU, else cpu), cpu or cuda; under "
        "serve, cuda gives each engine replica one GPU",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="weights and KV cache; auto = bfloat16 on a GPU, float32 on the CPU",
    )


def model_from_flags(args: argparse.Namespace, base: ModelConfig) -> ModelConfig:
    return replace(
        base,
        served_name=args.served_model_name or base.served_name,
        revision=args.revision,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        cuda_graphs=base.cuda_graphs and not args.enforce_eager,
    )


def engine_pool_fields(args: argparse.Namespace, pool: PoolConfig, name: str) -> dict[str, Any]:
    """The `PoolConfig` fields of engine pool `name` ("prefill", "decode") the flags set: its
    KV pool, scheduler and tensor parallel size."""
    cache = replace(
        pool.cache,
        num_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
    )
    scheduler = replace(
        pool.scheduler,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    tp = getattr(args, f"{name}_tensor_parallel_size") or args.tensor_parallel_size
    return {"cache": cache, "scheduler": scheduler, "tensor_parallel_size": tp}


def _bytes_arg(text: str) -> int:
    try:
        return byte_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_model(model: ModelConfig, local_path_too: bool = True) -> ModelConfig:
    """`model` checked before Ray starts, with a one-line InvalidArgument: a hub id resolved
    (cache, else download) and pinned to its commit; a directory read as a checkpoint
    (config, supported architecture, tokenizer, weights). `local_path_too` False skips a
    local path (joining a cluster, it may exist only on the engine nodes)."""
    from cluster.model.hub import is_hub_id, pinned
    from cluster.model.info import describe_model

    try:
        model = pinned(model)
        if local_path_too or is_hub_id(model.path):
            describe_model(model)
    except InvalidArgument as e:
        message = (
            e.message if e.message.startswith("model ") else f"model {model.path}: {e.message}"
        )
        raise InvalidArgument(message, param="model") from None
    return model
