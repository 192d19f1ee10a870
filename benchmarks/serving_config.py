"""The serving benchmark's options, its config and the apps it deploys."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.report import add_out_option
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig, TransferConfig
from cluster.model.make_model import cached_model
from cluster.serving.app_config import AppConfig, PoolConfig
from cluster.serving.cpu_affinity import cpu_list_arg

ADDED_LATENCY_TARGET_S = 1e-3  # per output token, served vs in-process
TRANSFER_SHARE_TARGET = 0.10  # KV transfer time / TTFT
APP, APP_COLOCATED = "bench", "bench-co"
MODES = {"disaggregated": APP, "colocated": APP_COLOCATED}
LABELS = {"disaggregated": "disaggregated", "colocated": "colocated"}
TTFT_TOKENS = 2  # the prefill's token, then one decode step after the KV transfer
# Section 3's runs per prompt length: `repeats`, at most this many. The KV share varies little
# from run to run; many repeats are for section 1's paired differences, and a 2046-token run
# takes seconds on a CPU.
TTFT_RUNS_MAX = 15
# The deployment whose engine decodes in each mode (its `time_decode` is the same-engine
# reference).
DECODING = {"disaggregated": "Decode", "colocated": "Colocated"}
# On a GPU, the engine replicas of both apps (prefill, decode, colocated) share GPU 0.
GPU_SHARE = 0.3


@dataclass(frozen=True)
class ServingBenchConfig:
    model_dir: Path
    preset: str
    decode_tokens: int  # N: output tokens of the decode-latency runs
    short_prompt: int  # prompt tokens of the decode-latency runs
    long_prompts: tuple[int, ...]  # prompt tokens of the KV transfer / TTFT runs
    repeats: int
    fetches: int  # timed fetches of each held prompt
    torch_threads: int
    replica_cpus: float
    block_size: int
    num_blocks: int
    chunk_tokens: int  # scheduler token budget per step: longer prompts are prefilled in chunks
    max_chunk_bytes: int  # KV transfer chunk size
    colocated: bool
    worker_niceness: int  # RAY_worker_niceness of a Ray this script starts itself
    seed: int
    device: str = "cpu"
    dtype: str = "float32"
    engine_cpus: tuple[int, ...] = ()  # engine threads here; Ray and this client elsewhere

    @property
    def ttft_runs(self) -> int:
        """Section 3's timed runs per prompt length."""
        return min(self.repeats, TTFT_RUNS_MAX)

    @property
    def modes(self) -> list[str]:
        """The apps measured side by side."""
        return ["disaggregated"] + (["colocated"] if self.colocated else [])


def parse_args(
    argv: list[str] | None, description: str | None = None
) -> tuple[argparse.Namespace, ServingBenchConfig]:
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    _add_options(p)
    a = p.parse_args(argv)
    q = a.quick
    if a.engine_cpus and a.grpc_port:
        p.error(
            "--engine-cpus needs a Ray this script starts (the running one is not kept off them)"
        )
    preset = "tiny" if q else "small"
    decode_tokens = a.decode_tokens or (12 if q else 64)
    if decode_tokens < 4:
        p.error("--decode-tokens must be >= 4")
    # The presets' max_position_embeddings is 2048 and the context includes the generated
    # tokens (prompt + max_tokens beyond it is refused). A 2047-token prompt has room for the
    # prefill's token only, so no KV ever moves; 2046 tokens is the longest prompt that is
    # handed to decode, with max_tokens 2 (same 128 KV blocks).
    long_prompts = (32, 126) if q else (512, 2046)
    need = -(-(max(long_prompts) + decode_tokens) // 16)
    cfg = ServingBenchConfig(
        model_dir=(a.model_dir or cached_model(preset)).expanduser().absolute(),
        preset=preset,
        decode_tokens=decode_tokens,
        short_prompt=16,
        long_prompts=long_prompts,
        repeats=a.repeats or (2 if q else 15),
        fetches=2 if q else 5,
        torch_threads=a.threads,
        replica_cpus=0.25 if q else 1.0,
        block_size=16,
        num_blocks=2 * need + 8,  # a held lease and a decoding copy of the longest prompt
        chunk_tokens=64 if q else 512,
        max_chunk_bytes=TransferConfig().max_chunk_bytes,
        colocated=not a.no_colocated,
        worker_niceness=a.worker_niceness,
        seed=0,
        device=a.device,
        dtype=a.dtype,
        engine_cpus=a.engine_cpus,
    )
    return a, cfg


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smoke run: tiny preset, short prompts")
    add_out_option(p, "serving")
    p.add_argument(
        "--grpc-port",
        type=int,
        default=0,
        help="use the Serve already running in this process's Ray, whose gRPC proxy is on "
        "this port (default: start a local Ray and Serve, and shut them down after)",
    )
    p.add_argument(
        "--model-dir", type=Path, default=None, help="checkpoint dir (default: the preset's)"
    )
    p.add_argument("--decode-tokens", type=int, default=None, help="default 64 (12 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="default 15 (2 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch threads, replicas and baseline")
    p.add_argument("--no-colocated", action="store_true", help="skip the colocated app")
    p.add_argument(
        "--worker-niceness",
        type=int,
        default=0,
        help="nice value of the Ray workers when this script starts Ray (Ray's own default is "
        "15, which starves the replicas on a machine shared with other work); the in-process "
        "baseline always runs at the decode replica's nice value",
    )
    p.add_argument(
        "--engine-cpus",
        type=cpu_list_arg,
        default=(),
        metavar="LIST",
        help="cores for the engine threads (replicas and baseline), e.g. 1; the Ray this script "
        "starts, its proxies, the router and the client run on the other cores "
        "(PoolConfig.engine_cpus, as `pdserve serve --engine-cpus`)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda: engine replicas and baseline")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")


def app_config(cfg: ServingBenchConfig) -> AppConfig:
    """The disaggregated app: 1 router, 1 prefill and 1 decode replica."""
    on_gpu = cfg.device.startswith("cuda")
    pool = PoolConfig(
        num_cpus=cfg.replica_cpus,
        num_gpus=GPU_SHARE if on_gpu else 0.0,
        torch_threads=cfg.torch_threads,
        engine_cpus=cfg.engine_cpus,
        cache=CacheConfig(block_size=cfg.block_size, num_blocks=cfg.num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=cfg.chunk_tokens),
    )
    return AppConfig(
        model=ModelConfig(path=str(cfg.model_dir), dtype=cfg.dtype, device=cfg.device),
        router=replace(pool, num_cpus=min(cfg.replica_cpus, 0.5), num_gpus=0.0, engine_cpus=()),
        prefill=pool,
        decode=pool,
        transfer=TransferConfig(
            lease_seconds=120.0, max_chunk_bytes=cfg.max_chunk_bytes, fetch_timeout_seconds=120.0
        ),
        default_max_tokens=cfg.decode_tokens,
        name=APP,
    )


def app_configs(cfg: ServingBenchConfig) -> dict[str, AppConfig]:
    """Mode -> its app: the disaggregated one and a colocated one, the same config otherwise."""
    app = app_config(cfg)
    return {
        "disaggregated": app,
        "colocated": replace(app, mode="colocated", name=APP_COLOCATED),
    }
