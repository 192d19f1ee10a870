"""The engine benchmark's Markdown report (the systems' tok/s side by side, the batch-1 floor,
the two targets) and its figures as JSON (`figures`, read by `benchmarks.gpu_summary`)."""

from __future__ import annotations

import dataclasses
import os

import torch

from benchmarks.engine_systems import SYSTEMS
from benchmarks.engine_workload import EngineBenchConfig, Measurement
from benchmarks.report import device_name, header

BANDWIDTH_TARGET = 1.5  # pdserve batch-1 step time <= this x the weight-read floor
SPEEDUP_TARGET = 3.0  # pdserve batch-32 decode >= this x generate_batch
SPEEDUP_BATCH = 32


def render(
    cfg: EngineBenchConfig,
    results: dict[str, list[Measurement]],
    weight_bytes: int,
    bandwidth: float,
    elapsed: float,
    argv: list[str],
) -> str:
    by = {s: {m.batch: m for m in ms} for s, ms in results.items()}
    lines = [
        *header("pdserve engine benchmark", "engine_bench", argv, cfg.device),
        *_setup(cfg, results, weight_bytes, elapsed),
        "",
        "| tok/s | " + " | ".join(SYSTEMS) + " | pdserve / generate_batch |",
        "|---" * (len(SYSTEMS) + 2) + "|",
    ]
    for kind in ("decode", "prefill"):
        for b in cfg.batches:
            ms = [by[s][b] for s in SYSTEMS]
            vals = [m.decode_tok_s if kind == "decode" else m.prefill_tok_s for m in ms]
            cells = [f"{v:,.1f}" for v in vals] + [f"{vals[0] / vals[2]:.2f}x"]
            lines.append(f"| {kind}, batch {b} | " + " | ".join(cells) + " |")
    floor = weight_bytes / bandwidth
    lines += [
        "",
        f"Copy bandwidth: {bandwidth / 1e9:.2f} GB/s ({cfg.copy_mib} MiB fp32 `dst.copy_(src)` on "
        f"{cfg.device}, best of 5); batch-1 floor = weight bytes / bandwidth = "
        f"{floor * 1e3:.1f} ms/step.",
        "",
        _bandwidth_target(by, floor),
        _speedup_target(by),
    ]
    return "\n".join(lines) + "\n"


def _setup(
    cfg: EngineBenchConfig, results: dict[str, list[Measurement]], weight_bytes: int, elapsed: float
) -> list[str]:
    import transformers

    loads = [m.other_load for ms in results.values() for m in ms]
    mean_load, max_load = sum(loads) / len(loads), max(loads)
    return [
        f"- CPUs this process may use: {len(os.sched_getaffinity(0))}",
        f"- {torch.get_num_threads()} torch threads; transformers {transformers.__version__}",
        f"- device: {cfg.device} ({device_name(cfg.device)}), dtype {cfg.dtype}; pdserve "
        f"CUDA-graph decode {'on' if cfg.cuda_graphs and cfg.device.startswith('cuda') else 'off'}",
        f"- model: `{cfg.preset}` preset at `{cfg.model_dir}`; a batch-1 step reads "
        f"{weight_bytes / 1e6:,.1f} MB of weights",
        f"- workload: random prompts of {cfg.prompt_len} tokens, {cfg.decode_len} greedy new "
        f"tokens each, EOS ignored; at most {cfg.batch_tokens} tokens/step (pdserve and "
        f"generate_batch); pdserve block {cfg.block_size}; generate_batch `sdpa`, page 256; "
        f"best of {cfg.repeats} run(s) per cell",
        f"- wall time: {elapsed:.0f} s; other processes used {mean_load:.0%} of the CPUs "
        f"during the measurements (worst run {max_load:.0%}) — with 2 cores, anything above a "
        "few percent makes these numbers unreliable (OpenMP threads wait on descheduled peers)",
    ]


def _bandwidth_target(by: dict[str, dict[int, Measurement]], floor: float) -> str:
    if 1 not in by["pdserve"]:
        return "- Target batch-1 bandwidth floor: not measured (batch 1 not run)"
    step = by["pdserve"][1].decode_step_s
    return (
        f"- Target batch-1 decode step <= {BANDWIDTH_TARGET}x floor: pdserve "
        f"{step * 1e3:.1f} ms/step = {step / floor:.2f}x floor: "
        + ("PASS" if step / floor <= BANDWIDTH_TARGET else "FAIL")
    )


def _speedup_target(by: dict[str, dict[int, Measurement]]) -> str:
    if SPEEDUP_BATCH not in by["pdserve"]:
        return f"- Target batch-{SPEEDUP_BATCH} speedup: not measured (batch not run)"
    pd = by["pdserve"][SPEEDUP_BATCH].decode_tok_s
    cb = by["hf generate_batch"][SPEEDUP_BATCH].decode_tok_s
    return (
        f"- Target batch-{SPEEDUP_BATCH} decode pdserve / generate_batch >= "
        f"{SPEEDUP_TARGET}x: {pd:,.1f} / {cb:,.1f} = {pd / cb:.2f}x: "
        + ("PASS" if pd / cb >= SPEEDUP_TARGET else "FAIL")
    )


def figures(
    cfg: EngineBenchConfig,
    results: dict[str, list[Measurement]],
    weight_bytes: int,
    bandwidth: float,
) -> dict:
    """What `--json` writes: the run's setup, the batch-1 floor and every measurement."""
    setup = {
        "preset": cfg.preset,
        "device": cfg.device,
        "dtype": cfg.dtype,
        "cuda_graphs": cfg.cuda_graphs and cfg.device.startswith("cuda"),
        "prompt_len": cfg.prompt_len,
        "decode_len": cfg.decode_len,
        "batch_tokens": cfg.batch_tokens,
    }
    return {
        **setup,
        "weight_bytes": weight_bytes,
        "copy_bandwidth": bandwidth,
        "floor_step_s": weight_bytes / bandwidth,
        "results": [
            {"system": s, **dataclasses.asdict(m)} for s, ms in results.items() for m in ms
        ],
    }
