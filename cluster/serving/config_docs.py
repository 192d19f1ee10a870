"""What each field of `AppConfig`'s dict form means: the `description` of every property in the
JSON schema (`pdserve config-schema`, `app_config_schema`). One sentence or two per field, for a
reader of a Serve config file; the longer why stays in the dataclasses' docstrings and
docs/configuration.md. `tests/cluster/serving/test_config_docs.py` fails when a field has no
description here, or a description names no field.
"""

from __future__ import annotations

from typing import Any

# The dataclass whose fields another's inherit (their descriptions are looked up there too).
_BASES = {"PoolConfig": "DeploymentConfig", "RouterConfig": "DeploymentConfig"}

FIELD_DOCS: dict[str, dict[str, str]] = {
    "AppConfig": {
        "model": "The checkpoint to serve and where it runs.",
        "mode": "disaggregated: a prefill and a decode pool; colocated: the decode pool's "
        "engines prefill and decode (the baseline).",
        "router": "The router deployment (ingress): size, resources, direct gRPC endpoint.",
        "prefill": "The prefill pool (unused in colocated mode).",
        "decode": "The decode pool (in colocated mode: the one engine pool).",
        "transfer": "How KV moves from prefill to decode workers.",
        "default_max_tokens": "Tokens generated for a request that sets no max_tokens (fitted "
        "to the context the prompt leaves).",
        "tool_call_parser": "The format tool calls are read in (vLLM's --tool-call-parser); "
        '"" for none.',
        "enable_auto_tool_choice": "Whether tool_choice auto may call tools (needs "
        "tool_call_parser).",
        "reasoning_parser": "The format reasoning is split out of answers in (vLLM's "
        '--reasoning-parser); "" for none.',
        "chat_template": "The chat template's text; \"\" for the tokenizer's own.",
        "default_chat_template_kwargs": "Template variables every chat request gets unless it "
        'sets them: a JSON object, e.g. {"enable_thinking": false}.',
        "generation_config": 'Sampling defaults for unset fields: "auto" the checkpoint\'s '
        'generation_config.json, "vllm" none, else a directory holding one.',
        "stream_interval": "Tokens per streamed message after the first, unless a request "
        "says (1: each token at once).",
        "request_timeout_seconds": "A request's deadline; past it DEADLINE_EXCEEDED / 504.",
        "max_retries": "Retries of a hop that failed UNAVAILABLE before any token was decoded.",
        "autoscaling": "Autoscaling across pools: the ratio policy that splits a replica budget "
        "between prefill and decode (each pool's own autoscaling is under the pool).",
        "max_migrations": "Resumes of a generation on another replica after a hop failed "
        "mid-stream.",
        "name": "The Serve application's name.",
    },
    "ModelConfig": {
        "path": "A Hugging Face checkpoint directory or hub id (org/name).",
        "served_name": 'What clients call the model (OpenAI model, metrics\' model_name); "" = '
        "the hub id or the directory's name.",
        "revision": 'A hub branch, tag or commit; "" = main.',
        "dtype": "Weights' and KV cache's dtype; \"auto\" = bfloat16 on a GPU, float32 on the CPU.",
        "device": '"cpu", "cuda", "cuda:N", or "auto" (cuda where torch sees a GPU).',
        "max_model_len": "Context limit in tokens; 0 = the checkpoint's max_position_embeddings.",
        "packed_weights": "fp32 on the CPU: also keep linear weights packed for MKL's GEMM "
        "(faster decode batches, about as much memory again as the weights).",
        "cuda_graphs": "GPU decode steps replay CUDA graphs; false = all eager (vLLM's "
        "--enforce-eager).",
    },
    "DeploymentConfig": {
        "replicas": "Fixed number of replicas; ignored when autoscaling is set.",
        "num_cpus": "CPUs Ray reserves per replica (engine pools: per rank, one bundle each "
        "at tensor_parallel_size > 1).",
        "num_gpus": "GPUs Ray reserves per replica (engine pools: per rank; 0 or 1 at "
        "tensor_parallel_size > 1).",
        "resources": "Custom Ray resources per replica (name to amount), e.g. to pin a pool "
        "to a node type.",
        "max_ongoing_requests": "Requests one replica works on at once; 0 = the pool's default "
        "(engine pools: scheduler.max_num_seqs; router: 1024).",
        "max_queued_requests": "Requests waiting for a replica beyond that; more are refused "
        "(RESOURCE_EXHAUSTED / 429). 0 = 4x max_ongoing_requests.",
        "autoscaling": "Per-pool autoscaling (bounds, delays, per-replica targets); none = a "
        "fixed size.",
    },
    "PoolConfig": {
        "tensor_parallel_size": "Ranks each engine replica spans (1, 2, 4 or 8), on one node "
        "(a STRICT_PACK placement group, a bundle per rank); 1, 2 or 4 in a disaggregated app.",
        "torch_threads": "torch's intra-op threads per engine rank; 0 = torch's default.",
        "gil_switch_interval_s": "Python's GIL switch interval in engine replicas: short, so "
        "the event loop's bursts stall an engine step briefly.",
        "engine_cpus": 'Cores the engine threads run on (a Linux cpu list "2-3", one core, or '
        "a list); empty = wherever the OS puts them.",
        "output_thread": "Detokenize and stream on a thread of its own while the engine runs "
        "the next step; none = on a GPU only.",
        "prefix_affinity": "Send a prompt to the replica that was sent the longest start of it "
        "(prefilling pools; the prefix cache must be on).",
        "affinity_max_imbalance": "Pass over an affine replica with more than this many calls "
        "open beyond the least loaded one.",
        "cache": "The paged KV pool.",
        "scheduler": "Batch size, token budget per step, admission queue.",
    },
    "RouterConfig": {
        "direct_grpc": "Each router replica also serves pdserve.v1.Generation itself (no "
        "Serve proxy) and lists it in GetStats.",
        "grpc_port": "The direct endpoint's port; 0 = a free one (a fixed port places one "
        "router replica per node).",
        "api_keys": "Keys a client must send (Authorization: Bearer KEY; gRPC metadata "
        "authorization) on every entry point but the health checks; none: no check. Shown "
        "redacted; prefer api_key_file or $PDSERVE_API_KEY.",
        "api_key_file": "A file of keys, one a line (# comments), read where the app is built.",
        "tls_cert_file": "PEM certificate the direct endpoints serve TLS with (with "
        "tls_key_file); read on each router's node.",
        "tls_key_file": "PEM private key of tls_cert_file.",
    },
    "CacheConfig": {
        "block_size": "Tokens per KV block, a power of two; the same in both pools.",
        "num_blocks": "KV blocks per replica; none = sized from kv_cache_memory or "
        "gpu_memory_utilization (CPU: 1024).",
        "gpu_memory_utilization": "Share of the GPU's memory the engine may fill, weights "
        "and activations included.",
        "kv_cache_memory": 'Bytes for the KV pool (an integer, or "4GiB"); on a GPU it '
        "overrides gpu_memory_utilization. 0 = not set.",
        "enable_prefix_caching": "Keep finished prompts' full KV blocks and reuse them for "
        "prompts with the same start.",
    },
    "SchedulerConfig": {
        "max_num_seqs": "Sequences running at once per engine.",
        "max_num_batched_tokens": "Token budget per engine step (longer prompts are chunked); "
        "none = 8192 on a GPU, 512 on the CPU.",
        "max_waiting": "Admission queue bound; beyond it requests are refused.",
    },
    "TransferConfig": {
        "transport": '"auto" (nixl where it works, else grpc), "nixl", "grpc", "gloo" or "nccl".',
        "host": 'Address the KV and token stream servers bind and advertise; "auto" = this '
        "node's Ray address (needed on more than one node).",
        "port": "The prefill replica's KV server port; 0 = a free one.",
        "lease_seconds": "How long prefilled KV waits for its decode worker before it is freed.",
        "max_chunk_bytes": "Bytes per gRPC KV chunk (4 KiB to 64 MiB).",
        "fetch_timeout_seconds": "One KV fetch's deadline.",
        "channel_idle_seconds": "A decode worker's channel to a prefill worker is closed after "
        "this long unused.",
        "secret": 'HMAC key of the KV capability tokens, hex; "" = one made per application.',
        "checksum": "Checksum every gRPC KV chunk (sender computes, receiver checks).",
    },
    "AppAutoscaling": {
        "ratio_policy": "Size prefill and decode together: the split of total_replicas the "
        "planner predicts best for the observed mix; none = each pool on its own signals.",
    },
    "RatioPolicySettings": {
        "profile": "Path of the planner profile JSON the split is simulated with (pdserve "
        "profile; recorded ones in cluster/planner/profiles/).",
        "total_replicas": "Engine replicas to split between the prefill and decode pools.",
        "slo_ttft_ms": "Time-to-first-token SLO the split is chosen for, in ms.",
        "slo_itl_ms": "Inter-token latency (TPOT) SLO the split is chosen for, in ms.",
        "interval_s": "Seconds between decisions.",
        "window_s": "The observed mix and arrival rate are those of this many last seconds.",
        "min_requests": "Fewer requests in the window: no decision, each pool scales on its "
        "own signals.",
        "sim_requests": "Requests in the synthetic mix simulated per split (a decision's cost).",
    },
    "AutoscalingSettings": {
        "min_replicas": "Fewest replicas (0 lets the pool scale to zero).",
        "max_replicas": "Most replicas.",
        "initial_replicas": "Replicas at start; none = min_replicas.",
        "upscale_delay_s": "How long the load must call for more replicas before they start.",
        "downscale_delay_s": "How long the load must call for fewer replicas before they stop.",
        "look_back_period_s": "Window the load is averaged over.",
        "targets": 'Load one replica should carry, per signal (e.g. {"running": 96}); empty = '
        "the pool's defaults.",
    },
}


def field_doc(cls_name: str, field: str) -> str | None:
    """The description of `cls_name`'s field `field` (inherited fields from their base)."""
    while cls_name:
        doc = FIELD_DOCS.get(cls_name, {}).get(field)
        if doc is not None:
            return doc
        cls_name = _BASES.get(cls_name, "")
    return None


def describe_fields(schema: dict[str, Any], root: str) -> None:
    """Put each field's description into `schema` (the root object is class `root`, the
    others are its `$defs`). A field already described by its type is given its own text."""
    objects = [(root, schema), *schema.get("$defs", {}).items()]
    for name, node in objects:
        for field, prop in node.get("properties", {}).items():
            doc = field_doc(name, field)
            if doc is not None:
                prop["description"] = doc
