"""Decode and prefill throughput of pdserve's Engine beside transformers, on one CPU checkpoint.

    python -m benchmarks.engine_bench [--out FILE] [--batches 1,8,32,128] ...

Three systems run the same greedy workload (B random prompts of `--prompt-len` tokens, exactly
`--decode-len` new tokens each, EOS ignored) in the same dtype on the same device: fp32 on the
CPU's threads by default, or `--device cuda --dtype bfloat16` on a GPU:

- pdserve: `Engine.step()` until done, one engine whose KV pool fits the largest batch;
- transformers `model.generate()`: one left-padded batch, `min_new_tokens == max_new_tokens`;
- transformers `model.generate_batch()`: its continuous-batching manager, model loaded with
  `attn_implementation="sdpa"` (besides `paged|eager` the only non-flash implementation it
  accepts; flash needs CUDA) and a `ContinuousBatchingConfig` giving page size, pool size and
  the same per-step token budget as pdserve (its defaults size the pool from GPU memory).

Every system reports, per request, the time each token appeared. From those: prefill tok/s is
`B * prompt_len` over the time from the first forward to the last request's first token, and
decode tok/s counts the tokens produced after that moment over the time to the last token, so
prefill never leaks into the decode number. The batch-1 bandwidth floor is the checkpoint's
weight bytes over a measured `dst.copy_(src)` rate on the same device: a batch-1 decode step must
read every weight.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.model.make_model import FORMAT_VERSION, make_model
from cluster.request import Request
from cluster.sampling_params import SamplingParams

SYSTEMS = ("pdserve", "hf generate", "hf generate_batch")
BANDWIDTH_TARGET = 1.5  # pdserve batch-1 step time <= this x the weight-read floor
SPEEDUP_TARGET = 3.0  # pdserve batch-32 decode >= this x generate_batch
SPEEDUP_BATCH = 32


@dataclass(frozen=True)
class BenchConfig:
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
    packed_weights: bool = True  # pdserve's ModelConfig.packed_weights

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


class OtherLoad:
    """How much CPU other processes took since construction: busy time in /proc/stat minus
    this process's own CPU time, as a share of all CPUs. Any load skews a 2-core benchmark
    (OpenMP threads wait on descheduled peers), so the report shows it."""

    def __init__(self) -> None:
        self.wall, self.busy, self.own = time.perf_counter(), _busy_seconds(), _own_seconds()

    def share(self) -> float:
        wall = time.perf_counter() - self.wall
        other = (_busy_seconds() - self.busy) - (_own_seconds() - self.own)
        return max(0.0, other / (wall * (os.cpu_count() or 1)))


def _busy_seconds() -> float:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def make_prompts(batch: int, cfg: BenchConfig, vocab_size: int) -> list[list[int]]:
    rng = random.Random(cfg.seed + batch)
    # Skip the low ids, where make_model's tokenizers keep their special tokens.
    return [[rng.randrange(16, vocab_size) for _ in range(cfg.prompt_len)] for _ in range(batch)]


# -- the three systems -------------------------------------------------------------------------


class PdserveRunner:
    def __init__(self, cfg: BenchConfig) -> None:
        biggest = max(cfg.batches)
        per_seq = -(-(cfg.prompt_len + cfg.decode_len) // cfg.block_size)
        self.engine = Engine(
            EngineConfig(
                model=ModelConfig(
                    path=str(cfg.model_dir),
                    dtype=cfg.dtype,
                    device=cfg.device,
                    packed_weights=cfg.packed_weights,
                ),
                cache=CacheConfig(block_size=cfg.block_size, num_blocks=biggest * per_seq + 8),
                scheduler=SchedulerConfig(
                    max_num_seqs=biggest, max_num_batched_tokens=cfg.batch_tokens
                ),
            )
        )
        self.cfg = cfg
        self.runs = 0

    @property
    def vocab_size(self) -> int:
        return self.engine.runner.model.spec.vocab_size

    def weight_bytes(self) -> int:
        """Bytes a batch-1 decode step must read: every weight once, except that the input
        embedding table is only row-gathered (unless it doubles as the tied lm_head)."""
        model = self.engine.runner.model
        params = {p.data_ptr(): p for p in model.parameters()}
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        if embed.data_ptr() != head.data_ptr():
            params.pop(embed.data_ptr())
        return sum(p.numel() * p.element_size() for p in params.values())

    def run(self, prompts: list[list[int]]) -> Timeline:
        self.runs += 1
        params = SamplingParams(max_tokens=self.cfg.decode_len, temperature=0.0, ignore_eos=True)
        ids = [f"r{self.runs}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            self.engine.add_request(Request(rid, tuple(p), params))
        times: dict[str, list[float]] = {rid: [] for rid in ids}
        start = time.perf_counter()
        while self.engine.has_work():
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                times[out.request_id].extend(now for _ in out.token_ids)
        assert self.engine.blocks.num_used == 0, "KV blocks leaked"
        return Timeline(start, [times[rid] for rid in ids])


class HFGenerateRunner:
    """`model.generate()` on one left-padded batch; a logits processor stamps every step."""

    def __init__(self, model, cfg: BenchConfig) -> None:
        self.model = model
        self.cfg = cfg

    def run(self, prompts: list[list[int]]) -> Timeline:
        from transformers import LogitsProcessor, LogitsProcessorList

        stamps: list[float] = []

        sync = self.cfg.sync

        class Stamp(LogitsProcessor):
            def __call__(self, input_ids, scores):
                sync()  # the step's logits exist; on a GPU the host is otherwise ahead
                stamps.append(time.perf_counter())
                return scores

        pad = self.model.generation_config.pad_token_id or 0
        width = max(len(p) for p in prompts)
        device = self.cfg.device
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        n = self.cfg.decode_len
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([Stamp()]),
            )
        assert out.shape[1] == width + n and len(stamps) == n, (out.shape, len(stamps))
        return Timeline(start, [list(stamps) for _ in prompts])


class HFGenerateBatchRunner:
    """`model.generate_batch()` (continuous batching); it stamps tokens itself."""

    def __init__(self, model, cfg: BenchConfig) -> None:
        self.model = model
        self.cfg = cfg

    def run(self, prompts: list[list[int]]) -> Timeline:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        cfg = self.cfg
        page = 256
        per_seq = -(-(cfg.prompt_len + cfg.decode_len) // page)
        # Its FIFO scheduler admits at most one new prompt per step once under 15% of the
        # blocks are free; leave that headroom so the batch is not serialised (pdserve's pool,
        # sized for the largest batch, has more than that for every smaller one).
        num_blocks = -(-len(prompts) * per_seq * 100 // 80) + 1
        gen = GenerationConfig(
            do_sample=False, max_new_tokens=cfg.decode_len, eos_token_id=-1, pad_token_id=0
        )
        # Field names moved between transformers releases (5.17: block_size; 5.24: page_size and
        # auto_switch_to_flash): pass what this version has.
        known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        options = {
            "page_size" if "page_size" in known else "block_size": page,
            "num_blocks": num_blocks,
            "max_batch_tokens": cfg.batch_tokens,
            "max_requests_per_batch": len(prompts),
        }
        if "auto_switch_to_flash" in known:
            options["auto_switch_to_flash"] = False
        cb = ContinuousBatchingConfig(**options)
        out = self.model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cb, record_timestamps=True
        )
        results = list(out.values())
        assert len(results) == len(prompts), "generate_batch lost requests"
        for r in results:
            assert r.error is None and len(r.generated_tokens) == cfg.decode_len, r
        return Timeline(min(r.lifespan[0] for r in results), [r.timestamps for r in results])


# -- the bandwidth floor -----------------------------------------------------------------------


def copy_bandwidth(cfg: BenchConfig, repeats: int = 5) -> float:
    """Bytes per second of `dst.copy_(src)` on two `copy_mib`-MiB fp32 tensors on the benchmark's
    device, best of `repeats` (the bytes counted are one tensor's, i.e. the rate at which a buffer
    can be streamed)."""
    n = cfg.copy_mib * (1 << 20) // 4
    src = torch.randn(n, device=cfg.device)
    dst = torch.empty(n, device=cfg.device)
    dst.copy_(src)  # fault the pages in
    cfg.sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        cfg.sync()
        best = min(best, time.perf_counter() - t)
    return n * 4 / best


# -- the report --------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"GPU {torch.cuda.get_device_name(device)}"
    return "CPU"


def render(
    cfg: BenchConfig,
    results: dict[str, list[Measurement]],
    weight_bytes: int,
    bandwidth: float,
    elapsed: float,
    argv: list[str],
) -> str:
    import transformers

    by = {s: {m.batch: m for m in ms} for s, ms in results.items()}
    loads = [m.other_load for ms in results.values() for m in ms]
    mean_load, max_load = sum(loads) / len(loads), max(loads)
    ratio_name = "pdserve / generate_batch"

    def row(label: str, values: list[float], ratio: float | None) -> str:
        cells = [f"{v:,.1f}" for v in values] + [f"{ratio:.2f}x" if ratio else "n/a"]
        return f"| {label} | " + " | ".join(cells) + " |"

    lines = [
        f"# pdserve engine benchmark, {datetime.date.today().isoformat()}",
        "",
        f"- machine: {os.cpu_count()} CPUs (`nproc` {len(os.sched_getaffinity(0))}), "
        f"{cpu_model()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        "at the end of the run",
        f"- torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"transformers {transformers.__version__}; Python {platform.python_version()}",
        f"- device: {cfg.device} ({device_name(cfg.device)}), dtype {cfg.dtype}; pdserve "
        f"packed weights {'on' if cfg.packed_weights else 'off'}",
        f"- model: `{cfg.preset}` preset at `{cfg.model_dir}`; a batch-1 step reads "
        f"{weight_bytes / 1e6:,.1f} MB of weights",
        f"- workload: random prompts of {cfg.prompt_len} tokens, {cfg.decode_len} greedy new "
        f"tokens each, EOS ignored; at most {cfg.batch_tokens} tokens/step (pdserve and "
        f"generate_batch); pdserve block {cfg.block_size}; generate_batch `sdpa`, page 256; "
        f"best of {cfg.repeats} run(s) per cell",
        f"- command: `python -m benchmarks.engine_bench {' '.join(argv)}`",
        f"- wall time: {elapsed:.0f} s; other processes used {mean_load:.0%} of the CPUs "
        f"during the measurements (worst run {max_load:.0%}) — with 2 cores, anything above a "
        "few percent makes these numbers unreliable (OpenMP threads wait on descheduled peers)",
        "",
        "| tok/s | " + " | ".join(SYSTEMS) + f" | {ratio_name} |",
        "|---" * (len(SYSTEMS) + 2) + "|",
    ]
    for kind in ("decode", "prefill"):
        for b in cfg.batches:
            ms = [by[s][b] for s in SYSTEMS]
            vals = [m.decode_tok_s if kind == "decode" else m.prefill_tok_s for m in ms]
            lines.append(row(f"{kind}, batch {b}", vals, vals[0] / vals[2]))
    floor = weight_bytes / bandwidth
    lines += [
        "",
        f"Copy bandwidth: {bandwidth / 1e9:.2f} GB/s ({cfg.copy_mib} MiB fp32 `dst.copy_(src)` on "
        f"{cfg.device}, best of 5); batch-1 floor = weight bytes / bandwidth = "
        f"{floor * 1e3:.1f} ms/step.",
        "",
    ]
    if 1 in by["pdserve"]:
        step = by["pdserve"][1].decode_step_s
        lines.append(
            f"- Target batch-1 decode step <= {BANDWIDTH_TARGET}x floor: pdserve "
            f"{step * 1e3:.1f} ms/step = {step / floor:.2f}x floor: "
            + ("PASS" if step / floor <= BANDWIDTH_TARGET else "FAIL")
        )
    else:
        lines.append("- Target batch-1 bandwidth floor: not measured (batch 1 not run)")
    if SPEEDUP_BATCH in by["pdserve"]:
        pd = by["pdserve"][SPEEDUP_BATCH].decode_tok_s
        cb = by["hf generate_batch"][SPEEDUP_BATCH].decode_tok_s
        lines.append(
            f"- Target batch-{SPEEDUP_BATCH} decode pdserve / generate_batch >= "
            f"{SPEEDUP_TARGET}x: {pd:,.1f} / {cb:,.1f} = {pd / cb:.2f}x: "
            + ("PASS" if pd / cb >= SPEEDUP_TARGET else "FAIL")
        )
    else:
        lines.append(f"- Target batch-{SPEEDUP_BATCH} speedup: not measured (batch not run)")
    return "\n".join(lines) + "\n"


# -- driver ------------------------------------------------------------------------------------


def default_model_dir(preset: str) -> Path:
    root = os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve"
    return Path(root).expanduser().absolute() / "models" / f"{preset}-{FORMAT_VERSION}"


def ensure_model(preset: str, path: Path) -> Path:
    if not (path / "config.json").is_file():
        try:
            make_model(preset, path, seed=0)
        except FileExistsError:  # a concurrent build won
            pass
    return path


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, BenchConfig]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset", default=None, help="make_model preset (default small; tiny with --quick)"
    )
    p.add_argument("--model-dir", type=Path, default=None, help="checkpoint dir; built if absent")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (16 with --quick)")
    p.add_argument("--decode-len", type=int, default=None, help="default 64 (8 with --quick)")
    p.add_argument("--batches", default=None, help="default 1,8,32,128 (1,2 with --quick)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--batch-tokens", type=int, default=4096, help="tokens/step for pdserve and generate_batch"
    )
    p.add_argument("--copy-mib", type=int, default=None, help="default 1024 (64 with --quick)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell; the best is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N; every system runs there")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument(
        "--no-packed-weights",
        action="store_true",
        help="pdserve without its packed fp32 GEMM weights (ModelConfig.packed_weights=False)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: tiny preset, batches 1,2")
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown report here")
    a = p.parse_args(argv)
    q = a.quick
    preset = a.preset or ("tiny" if q else "small")
    batches = tuple(int(b) for b in (a.batches or ("1,2" if q else "1,8,32,128")).split(","))
    prompt_len = a.prompt_len or (16 if q else 128)
    decode_len = a.decode_len or (8 if q else 64)
    if decode_len < 2 or prompt_len < 1 or min(batches) < 1 or a.repeats < 1:
        p.error("need --decode-len >= 2, --prompt-len >= 1, --repeats >= 1, positive batches")
    cfg = BenchConfig(
        model_dir=(a.model_dir or default_model_dir(preset)).expanduser().absolute(),
        preset=preset,
        prompt_len=prompt_len,
        decode_len=decode_len,
        batches=batches,
        block_size=a.block_size,
        batch_tokens=a.batch_tokens,
        copy_mib=a.copy_mib or (64 if q else 1024),
        repeats=a.repeats,
        seed=a.seed,
        device=a.device,
        dtype=a.dtype,
        packed_weights=not a.no_packed_weights,
    )
    return a, cfg


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print the Markdown report and return it. Process-wide settings it
    changes (torch threads, transformers logging) are restored on the way out."""
    import logging

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
        report = run(cfg, argv)
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
        cb_logger.setLevel(cb_level)
    return publish(report, args.out)


def publish(report: str, out: str | Path | None) -> str:
    """Print a benchmark's Markdown report and, given `out`, write it there too."""
    print(report)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(report, "utf-8")
    return report


def common_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options of the smaller benchmarks: the checkpoint, torch threads, the report file.
    Their `main` runs `publish(with_threads(args.threads, ...), args.out)`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--model-dir", default=None, help="checkpoint dir (default: the preset's)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--out", default=None, help="also write the Markdown report here")
    return p


def with_threads(threads: int, make_report: Callable[[], str]) -> str:
    """`make_report()` with `threads` torch threads (0: as they are), restored afterwards."""
    before = torch.get_num_threads()
    try:
        if threads > 0:
            torch.set_num_threads(threads)
        return make_report()
    finally:
        torch.set_num_threads(before)


def machine_line() -> str:
    """The report line naming the machine and the software that ran it."""
    return (
        f"- machine: {torch.get_num_threads()} torch threads, {cpu_model()}, "
        f"{platform.platform()}, torch {torch.__version__}"
    )


def run(cfg: BenchConfig, argv: list[str]) -> str:
    from transformers import AutoModelForCausalLM

    began = time.perf_counter()
    ensure_model(cfg.preset, cfg.model_dir)
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
            tries = []
            for _ in range(cfg.repeats):
                t = time.perf_counter()
                m = measure(runners[name], prompts)
                tries.append(m)
                log(
                    f"batch {b:>4} {name:<18} decode {m.decode_tok_s:9.1f} tok/s "
                    f"({m.decode_step_s * 1e3:7.1f} ms/step)  prefill {m.prefill_tok_s:9.1f} "
                    f"tok/s  [{time.perf_counter() - t:.1f} s, other load {m.other_load:.0%}]"
                )
            results[name].append(best(tries))
    bandwidth = copy_bandwidth(cfg)
    elapsed = time.perf_counter() - began
    return render(cfg, results, pdserve.weight_bytes(), bandwidth, elapsed, argv)


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


if __name__ == "__main__":
    main()
