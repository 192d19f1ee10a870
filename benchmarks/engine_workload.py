"""The engine benchmark's workload and measurements: its config, the prompts, each run's token
timeline and what is read off it, and the device's copy bandwidth (the batch-1 floor)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.proc_stats import OtherLoad
from cluster.config import ModelConfig


@dataclass(frozen=True)
class EngineBenchConfig:
    model_dir: Path
    preset: str
    prompt_len: int
    decode_len: int
    batches: tuple[int, ...]
    block_size: int
    batch_tokens: int  # token budget per step, pdserve and generate_batch alike
    copy_mib: int
    repeats: int  # runs per (system, batch); the best is reported
    seed: int
    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool = True  # pdserve's ModelConfig.cuda_graphs (decode graphs on a GPU)

    @property
    def torch_dtype(self) -> torch.dtype:
        return ModelConfig(str(self.model_dir), dtype=self.dtype).torch_dtype

    def sync(self) -> None:
        """Wait for queued device work, so a host clock read after it is the work's end."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class Timeline:
    """When each of B requests got each of its tokens (perf_counter seconds), and when the
    first forward began. Token 0 of every request is the one its prefill sampled."""

    start: float
    token_times: list[list[float]]

    def prefill_tok_s(self, prompt_len: int) -> float:
        done = max(t[0] for t in self.token_times)
        return len(self.token_times) * prompt_len / (done - self.start)

    def decode(self) -> tuple[int, float]:
        """(tokens, seconds) of pure decode: after the last prompt's prefill sampled."""
        done = max(t[0] for t in self.token_times)
        end = max(t[-1] for t in self.token_times)
        tokens = sum(1 for ts in self.token_times for x in ts if x > done)
        return tokens, end - done


@dataclass(frozen=True)
class Measurement:
    batch: int
    prefill_tok_s: float
    decode_tok_s: float
    decode_step_s: float  # decode seconds / decode steps of the longest request
    other_load: float  # share of all CPUs that other processes used during the run


def measure(run: Callable[[list[list[int]]], Timeline], prompts: list[list[int]]) -> Measurement:
    load = OtherLoad()
    timeline = run(prompts)
    other = load.share()
    tokens, seconds = timeline.decode()
    steps = max(len(t) for t in timeline.token_times) - 1
    return Measurement(
        batch=len(prompts),
        prefill_tok_s=timeline.prefill_tok_s(len(prompts[0])),
        decode_tok_s=tokens / seconds,
        decode_step_s=seconds / steps,
        other_load=other,
    )


def best(tries: list[Measurement]) -> Measurement:
    """The best decode and the best prefill of repeated runs (noise only ever slows a run)."""
    fastest = max(tries, key=lambda m: m.decode_tok_s)
    return Measurement(
        batch=fastest.batch,
        prefill_tok_s=max(m.prefill_tok_s for m in tries),
        decode_tok_s=fastest.decode_tok_s,
        decode_step_s=fastest.decode_step_s,
        other_load=sum(m.other_load for m in tries) / len(tries),
    )


def make_prompts(batch: int, cfg: EngineBenchConfig, vocab_size: int) -> list[list[int]]:
    rng = random.Random(cfg.seed + batch)
    # Skip the low ids, where make_model's tokenizers keep their special tokens.
    return [[rng.randrange(16, vocab_size) for _ in range(cfg.prompt_len)] for _ in range(batch)]


def copy_bandwidth(cfg: EngineBenchConfig, repeats: int = 5) -> float:
    """Bytes per second of `dst.copy_(src)` on two `copy_mib`-MiB fp32 tensors on the benchmark's
    device, best of `repeats` (the bytes counted are one tensor's, i.e. the rate at which a buffer
    can be streamed)."""
    n = cfg.copy_mib * (1 << 20) // 4
    src = torch.randn(n, device=cfg.device)
    dst = torch.empty(n, device=cfg.device)
    dst.copy_(src)  # fault the pages in
    cfg.sync()
    fastest = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        cfg.sync()
        fastest = min(fastest, time.perf_counter() - t)
    return n * 4 / fastest
