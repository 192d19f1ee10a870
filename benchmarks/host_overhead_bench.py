"""The engine's own host time per sequence per decode step, the model forward left out.

    python -m benchmarks.host_overhead_bench [--batch 256] [--steps 64] [--repeats 5]

On a GPU the engine is host-bound: everything `Engine.step()` does around the forward pass
(schedule, build the step's inputs, sample, append tokens and check stops, build the
`StepOutput`s) is CPU time per sequence that the GPU waits for. Text (detokenization, stop
strings) is not part of it: as `AsyncEngine` runs it, the step returns token ids and its
output thread makes the text while the next step runs; that work is timed on its own. Here
the forward is a stub (`StubModel`: fixed random logits, a different row per sequence and
step), so a CPU measures exactly the host work: `batch` sequences of the `tiny` preset in pure
decode, greedy, `ignore_eos`, one torch thread. Each repeat times every step in process CPU
time, minus the stub's own, and less the sampler's argmax over the logits (timed alone: a
device kernel on a GPU, CPU time only because the CPU is the device here), and then the
output processor on the step's outputs; a second, instrumented pass splits them by phase
(wall clock per call, less the timer's own cost; "sample" includes the argmax).
Target (issue 20): ≤ 10 µs of host time per sequence per step at batch 256.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from benchmarks.report import add_out_option, header, log, publish
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.engine.sequence import Sequence
from cluster.model.make_model import cached_model
from cluster.request import Request
from cluster.sampling_params import SamplingParams

PROMPT_LEN = 16
TARGET_US = 10.0


class StubModel:
    """Stands in for the CausalLM: no compute, logits from a fixed random table."""

    def __init__(self, vocab: int, rows: int = 1024) -> None:
        self.table = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
        self.offset = 0
        self.cpu_ns = 0  # process CPU time spent in the stub

    def __call__(self, input_ids: torch.Tensor, *_) -> torch.Tensor:
        t = time.process_time_ns()
        hidden = torch.zeros(input_ids.shape[0], 1)  # [T, 1]
        self.cpu_ns += time.process_time_ns() - t
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, vocab]
        t = time.process_time_ns()
        self.offset = (self.offset + 7) % (self.table.shape[0] - hidden.shape[0])
        out = self.table[self.offset : self.offset + hidden.shape[0]]
        self.cpu_ns += time.process_time_ns() - t
        return out


def stub_engine(batch: int, steps: int) -> tuple[Engine, StubModel]:
    blocks_per_seq = (PROMPT_LEN + steps + 2) // 16 + 2
    config = EngineConfig(
        ModelConfig(path=str(cached_model("tiny")), packed_weights=False),
        CacheConfig(num_blocks=batch * blocks_per_seq, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT_LEN),
    )
    engine = Engine(config)
    engine.detokenize_in_step = False  # as `AsyncEngine` runs it: text on another thread
    stub = StubModel(engine.info.spec.vocab_size)
    engine.runner.model = stub
    return engine, stub


def decode_steps(
    engine: Engine,
    stub: StubModel,
    batch: int,
    steps: int,
    stop: tuple,
    decoding: Callable[[bool], None] = lambda on: None,
) -> tuple[list[int], list[int]]:
    """Admit `batch` requests, prefill them in one step, then time `steps` decode steps: host
    CPU ns per step (the stub's excluded) and of the output processor on its outputs.
    `decoding(True/False)` brackets those steps."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True, stop=stop)
    gen = torch.Generator().manual_seed(1)
    vocab = engine.info.spec.vocab_size
    for i in range(batch):
        ids = torch.randint(4, vocab, (PROMPT_LEN,), generator=gen).tolist()
        engine.add_request(Request(f"r{i}", tuple(ids), params))
    processor = engine.output_processor
    processor.process(engine.step())  # the prefill
    per_step, per_text = [], []
    decoding(True)
    for _ in range(steps):
        stub.cpu_ns = 0
        t = time.process_time_ns()
        outs = engine.step()
        u = time.process_time_ns()
        outs, stopped = processor.process(outs)
        per_text.append(time.process_time_ns() - u)
        per_step.append(u - t - stub.cpu_ns)
        assert len(outs) == batch and not stopped
    decoding(False)
    while engine.has_work():
        processor.process(engine.step())
    return per_step, per_text


PHASES = {  # phase: (owner attribute path, method)
    "schedule": ("scheduler", "schedule"),
    "prepare inputs": ("runner", "prepare"),
    "sample": ("runner", "_sample"),
    "mark computed": ("scheduler", "computed"),
}


def argmax_kernel(stub: StubModel, batch: int, steps: int) -> float:
    """Process CPU µs per sequence of the sampler's greedy pick over `[batch, vocab]` logits:
    a kernel on the device, which on the CPU is the CPU (on a GPU it is not host time)."""
    logits = stub.table[:batch]
    t = time.process_time_ns()
    for _ in range(steps):
        logits.max(dim=-1).indices.tolist()
    return (time.process_time_ns() - t) / steps / batch / 1e3


def phase_split(engine: Engine, stub: StubModel, batch: int, steps: int, stop: tuple) -> dict:
    """Mean µs per sequence per step of each phase, from wall-clock wrappers."""
    spent: dict[str, int] = defaultdict(int)
    live = [False]
    overhead = _timer_overhead()

    def wrap(name: str, fn: Callable) -> Callable:
        def timed(*a, **kw):
            t = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                if live[0]:
                    spent[name] += time.perf_counter_ns() - t - overhead

        return timed

    for name, (owner, method) in PHASES.items():
        obj = getattr(engine, owner)
        setattr(obj, method, wrap(name, getattr(obj, method)))
    append_token = Sequence.append_token
    Sequence.append_token = wrap("append + stop check", append_token)
    detoks = _wrap_detokenizer(engine, wrap)
    processor = engine.output_processor
    processor.process = wrap("output processor", processor.process)
    step = engine.step
    engine.step = wrap("step", step)
    stub_calls = wrap("forward (stub)", stub.__call__), wrap("forward (stub)", stub.logits)
    engine.runner.model = _Forward(*stub_calls)
    try:
        decode_steps(engine, stub, batch, steps, stop, lambda on: live.__setitem__(0, on))
    finally:
        Sequence.append_token = append_token
        detoks()
        for _, (owner, _m) in PHASES.items():
            vars(getattr(engine, owner)).pop(_m, None)
        del engine.step
        del processor.process
        engine.runner.model = stub
    n = batch * steps
    named = sum(spent[k] for k in [*PHASES, "append + stop check"])
    spent["outputs + rest"] = spent["step"] - spent["forward (stub)"] - named
    spent["text: rest"] = spent["output processor"] - spent["detokenize"]
    return {k: v / n / 1e3 for k, v in spent.items() if k in [*STEP_ROWS, *TEXT_ROWS]}


STEP_ROWS = [*PHASES, "append + stop check", "outputs + rest"]
TEXT_ROWS = ["detokenize", "text: rest"]


class _Forward:
    def __init__(self, call: Callable, logits: Callable) -> None:
        self.call, self.logits = call, logits

    def __call__(self, *a):
        return self.call(*a)


def _wrap_detokenizer(engine: Engine, wrap: Callable) -> Callable[[], None]:
    """Time the detokenizer's methods (whatever class the engine uses); returns the undo."""
    import cluster.engine.detokenizer as mod

    undo = []
    for cls in vars(mod).values():
        if isinstance(cls, type) and cls.__module__ == mod.__name__:
            for name in ("add", "take", "step"):
                if name in vars(cls):
                    fn = vars(cls)[name]
                    setattr(cls, name, wrap("detokenize", fn))
                    undo.append((cls, name, fn))

    def restore() -> None:
        for cls, name, fn in undo:
            setattr(cls, name, fn)

    return restore


def _timer_overhead() -> int:
    samples = []
    for _ in range(2000):
        t = time.perf_counter_ns()
        u = time.perf_counter_ns()
        samples.append(u - t)
    return int(statistics.median(samples))


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stop", action="append", default=[], help="a stop string every request has")
    add_out_option(p, "host_overhead")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    stop = tuple(a.stop)
    engine, stub = stub_engine(a.batch, a.steps)
    decode_steps(engine, stub, a.batch, 4, stop)  # warm up
    totals, texts, kernels, splits = [], [], [], []
    for r in range(a.repeats):
        per_step, per_text = decode_steps(engine, stub, a.batch, a.steps, stop)
        totals.append(statistics.median(per_step) / a.batch / 1e3)
        texts.append(statistics.median(per_text) / a.batch / 1e3)
        kernels.append(argmax_kernel(stub, a.batch, a.steps))
        splits.append(phase_split(engine, stub, a.batch, a.steps, stop))
        log(f"repeat {r + 1}: step {totals[-1]:.2f}, text {texts[-1]:.2f} µs per sequence")
    total, kernel = statistics.median(totals), statistics.median(kernels)
    text = statistics.median(texts)
    verdict = "PASS" if total - kernel <= TARGET_US else "FAIL"
    lines = header("Engine host time per sequence per step", "host_overhead_bench", argv or [])
    lines += [
        "",
        f"Batch {a.batch}, pure decode, `tiny` preset, stub forward, stop strings {stop or 'none'}"
        f"; {a.repeats} repeats of {a.steps} steps.",
        "",
        f"CPU time per sequence per step, forward excluded: {total:.2f} µs (median of repeats;"
        f" repeats {min(totals):.2f}-{max(totals):.2f}), of which the greedy argmax kernel "
        f"{kernel:.2f} µs (device work on a GPU).",
        "",
        f"**Host time per sequence per step: {total - kernel:.2f} µs**; target ≤ "
        f"{TARGET_US:.0f} µs: **{verdict}**",
        "",
        f"Off the step, on the output thread: text and stop strings {text:.2f} µs per sequence"
        f" per step (repeats {min(texts):.2f}-{max(texts):.2f}); in the step, as an engine that"
        f" detokenizes itself runs, the host time would be {total - kernel + text:.2f} µs.",
        "",
        "| phase (instrumented pass) | µs per sequence per step |",
        "|---|---|",
    ]
    for name in [*STEP_ROWS, *(f"output thread: {n}" for n in TEXT_ROWS)]:
        key = name.removeprefix("output thread: ")
        lines.append(f"| {name} | {statistics.median(s.get(key, 0.0) for s in splits):.2f} |")
    return publish("\n".join(lines) + "\n", a.out)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
