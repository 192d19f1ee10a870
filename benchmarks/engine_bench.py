"""pdserve's Engine beside transformers: decode and prefill throughput on one checkpoint.

    python -m benchmarks.engine_bench [--quick] [--batches 1,8,32,128] [--out FILE] [--json FILE]

Three systems run the same greedy workload (B random prompts of `--prompt-len` tokens, exactly
`--decode-len` new tokens each, EOS ignored), same dtype and device (fp32 on the CPU by default,
or `--device cuda --dtype bfloat16`): pdserve's `Engine.step()` until done; transformers
`generate()` on one left-padded batch; transformers `generate_batch()` (continuous batching,
`sdpa`, pdserve's per-step token budget). Prefill tok/s is `B * prompt_len` over the time until
the last first token; decode tok/s counts the tokens after it. The batch-1 floor is the weight
bytes over a measured copy rate (a batch-1 step reads every weight). `--json`: the figures for
`benchmarks.gpu_summary`. `--structured`: pdserve alone, per batch with and without `SCHEMA`
(xgrammar; no output ends early): ms per decode step, the cost of structured output.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.engine_report import figures, render
from benchmarks.engine_systems import (
    SYSTEMS,
    HFGenerateBatchRunner,
    HFGenerateRunner,
    PdserveRunner,
)
from benchmarks.engine_workload import (
    EngineBenchConfig,
    Measurement,
    Timeline,
    best,
    copy_bandwidth,
    make_prompts,
    measure,
)
from benchmarks.report import add_out_option, header, log, publish
from cluster.config import GPU_BATCHED_TOKENS
from cluster.model.make_model import cached_model
from cluster.structured_output import StructuredOutput

CPU_BENCH_TOKENS = 4096  # the CPU figures' budget since the first report: kept comparable
SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 1024}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, EngineBenchConfig]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset", default=None, help="make_model preset (default small; tiny with --quick)"
    )
    p.add_argument(
        "--model-dir", type=Path, default=None, help="checkpoint dir (default: the preset's)"
    )
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (16 with --quick)")
    p.add_argument("--decode-len", type=int, default=None, help="default 64 (8 with --quick)")
    p.add_argument("--batches", default=None, help="default 1,8,32,128 (1,2 with --quick)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell; the best is reported")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N; every system runs there")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    graphs = "on a GPU, pdserve decodes replaying CUDA graphs; --no-cuda-graphs: all eager"
    p.add_argument(
        "--cuda-graphs", action=argparse.BooleanOptionalAction, default=True, help=graphs
    )
    p.add_argument("--quick", action="store_true", help="smoke run: tiny preset, batches 1,2")
    p.add_argument("--structured", action="store_true", help="the constrained-decoding cost")
    add_out_option(p, "engine")
    p.add_argument("--json", default=None, help="also write the figures here, as JSON")
    a = p.parse_args(argv)
    if a.structured and a.out.endswith("engine.md"):
        a.out = a.out.removesuffix(".md") + "_structured.md"
    q = a.quick
    preset = a.preset or ("tiny" if q else "small")
    batches = tuple(int(b) for b in (a.batches or ("1,2" if q else "1,8,32,128")).split(","))
    prompt_len = a.prompt_len or (16 if q else 128)
    decode_len = a.decode_len or (8 if q else 64)
    if decode_len < 2 or prompt_len < 1 or min(batches) < 1 or a.repeats < 1:
        p.error("need --decode-len >= 2, --prompt-len >= 1, --repeats >= 1, positive batches")
    cfg = EngineBenchConfig(
        model_dir=(a.model_dir or cached_model(preset)).expanduser().absolute(),
        preset=preset,
        prompt_len=prompt_len,
        decode_len=decode_len,
        batches=batches,
        block_size=16,
        batch_tokens=GPU_BATCHED_TOKENS if a.device.startswith("cuda") else CPU_BENCH_TOKENS,
        copy_mib=64 if q else 1024,
        repeats=a.repeats,
        seed=0,
        device=a.device,
        dtype=a.dtype,
        cuda_graphs=a.cuda_graphs,
    )
    return a, cfg


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print the Markdown report, write it to `--out` (and its figures to
    `--json`) and return it.
    Process-wide settings it changes (torch threads, transformers logging) are restored on the
    way out."""
    from transformers.utils import logging as hf_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    args, cfg = parse_args(argv)
    threads, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    cb_level = cb_logger.level
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        hf_logging.set_verbosity_error()
        cb_logger.setLevel(logging.CRITICAL)  # psutil and CPU-memory chatter
        report, figs = (run_structured if args.structured else run)(cfg, argv)
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
        cb_logger.setLevel(cb_level)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figs, indent=1) + "\n", "utf-8")
    return publish(report, args.out)


def run(cfg: EngineBenchConfig, argv: list[str]) -> tuple[str, dict]:
    """The Markdown report and the figures (`engine_report.figures`)."""
    from transformers import AutoModelForCausalLM

    began = time.perf_counter()
    pdserve = PdserveRunner(cfg)
    hf = AutoModelForCausalLM.from_pretrained(
        cfg.model_dir, dtype=cfg.torch_dtype, attn_implementation="sdpa"
    )
    hf = hf.to(cfg.device).eval()
    runners: dict[str, Callable[[list[list[int]]], Timeline]] = {
        "pdserve": pdserve.run,
        "hf generate": HFGenerateRunner(hf, cfg).run,
        "hf generate_batch": HFGenerateBatchRunner(hf, cfg).run,
    }
    warm = make_prompts(1, cfg, pdserve.vocab_size)
    for runner in runners.values():
        runner(warm)
    results: dict[str, list[Measurement]] = {s: [] for s in SYSTEMS}
    for b in cfg.batches:
        prompts = make_prompts(b, cfg, pdserve.vocab_size)
        for name in SYSTEMS:
            results[name].append(
                best([_timed(runners[name], name, prompts) for _ in range(cfg.repeats)])
            )
    bandwidth = copy_bandwidth(cfg)
    elapsed = time.perf_counter() - began
    weight_bytes = pdserve.weight_bytes()
    return (
        render(cfg, results, weight_bytes, bandwidth, elapsed, argv),
        figures(cfg, results, weight_bytes, bandwidth),
    )


def run_structured(cfg: EngineBenchConfig, argv: list[str]) -> tuple[str, dict]:
    """The report, and {batch: [free, constrained] seconds per decode step}, interleaved."""
    began, pdserve = time.perf_counter(), PdserveRunner(cfg)
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    runners = {"free": pdserve.run, "json schema": lambda p: pdserve.run(p, so)}
    for runner in runners.values():  # warm; compiles the grammar once
        runner(make_prompts(1, cfg, pdserve.vocab_size))
    steps: dict[str, list[float]] = {}
    for b in cfg.batches:
        prompts = make_prompts(b, cfg, pdserve.vocab_size)
        tries = {n: [_timed(r, n, prompts) for _ in range(cfg.repeats)] for n, r in runners.items()}
        steps[str(b)] = [best(t).decode_step_s for t in tries.values()]
    return "\n".join([
        *header("pdserve structured-output cost", "engine_bench", argv, cfg.device),
        f"- workload: {cfg.preset}, {cfg.dtype} on {cfg.device}, greedy, {cfg.prompt_len}-token "
        f"prompts, {cfg.decode_len} new tokens, best of {cfg.repeats}, constraint "
        f"`{json.dumps(SCHEMA)}`; {time.perf_counter() - began:.0f} s\n",
        "| batch | ms per decode step, free | with the JSON schema | constrained / free |",
        "|---|---|---|---|",
        *(f"| {b} | {f * 1e3:.1f} | {c * 1e3:.1f} | {c / f:.2f}x |" for b, (f, c) in steps.items()),
    ]) + "\n", steps  # fmt: skip


def _timed(runner: Callable[[list[list[int]]], Timeline], name: str, prompts) -> Measurement:
    t = time.perf_counter()
    m = measure(runner, prompts)
    log(
        f"batch {len(prompts):>4} {name:<18} decode {m.decode_tok_s:9.1f} tok/s "
        f"({m.decode_step_s * 1e3:7.1f} ms/step)  prefill {m.prefill_tok_s:9.1f} "
        f"tok/s  [{time.perf_counter() - t:.1f} s, other load {m.other_load:.0%}]"
    )
    return m


if __name__ == "__main__":
    main()
