"""What slows a decode step down: other Python work in the engine's process, or in another one.

    python -m benchmarks.interference_bench [--preset small] [--busy-ms 3.4] [--out FILE]

A decode replica's engine thread shares its process, and so its GIL, with Serve's event loop,
which spends a few ms of Python per streamed token. This runs batch-1 greedy decoding with one
torch thread (as the serving benchmark's replicas do) and measures the mean step:

- alone;
- beside a thread of this process that runs Python for `--busy-ms` of every `--period-ms`
  (holding the GIL as Serve's loop does), at Python's default switch interval and at 50 us;
- beside a separate process that spins for the same share of time (no shared GIL).

Rounds are interleaved; medians are reported.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time

import torch

from benchmarks.options import common_parser, model_dir, with_threads
from benchmarks.report import header, publish
from cluster.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.engine import Engine
from cluster.request import Request
from cluster.sampling_params import SamplingParams

SPIN = """
import time
while True:
    s = time.perf_counter()
    while time.perf_counter() - s < {busy}:
        pass
    time.sleep({rest})
"""


def spin_thread(stop: threading.Event, busy_s: float, rest_s: float) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < busy_s:
            pass
        time.sleep(rest_s)


def mean_step_ms(engine: Engine, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(Request(f"i{time.perf_counter()}", tuple(range(20, 36)), params))
    stamps = []
    while engine.has_work():
        engine.step()
        stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[2]) / (len(stamps) - 3) * 1e3


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = common_parser(__doc__, "interference")
    p.add_argument("--busy-ms", type=float, default=3.4, help="Python work per period")
    p.add_argument("--period-ms", type=float, default=66.0, help="about one decode step")
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=4)
    p.set_defaults(threads=1)
    a = p.parse_args(argv)
    return publish(with_threads(a.threads, lambda: measure(a, argv)), a.out)


def measure(a, argv: list[str]) -> str:
    engine = Engine(EngineConfig(ModelConfig(str(model_dir(a))), CacheConfig(num_blocks=64)))
    busy, rest = a.busy_ms / 1e3, (a.period_ms - a.busy_ms) / 1e3
    mean_step_ms(engine, a.tokens)  # warm-up

    def alone() -> float:
        return mean_step_ms(engine, a.tokens)

    def with_thread(switch: float) -> float:
        stop, default = threading.Event(), sys.getswitchinterval()
        sys.setswitchinterval(switch)
        thread = threading.Thread(target=spin_thread, args=(stop, busy, rest))
        thread.start()
        try:
            return mean_step_ms(engine, a.tokens)
        finally:
            stop.set()
            thread.join()
            sys.setswitchinterval(default)

    def with_process() -> float:
        proc = subprocess.Popen([sys.executable, "-c", SPIN.format(busy=busy, rest=rest)])
        try:
            time.sleep(0.3)
            return mean_step_ms(engine, a.tokens)
        finally:
            proc.kill()
            proc.wait()

    cases = {
        "alone": alone,
        "busy thread in this process (GIL shared), switch interval 5 ms": lambda: with_thread(
            0.005
        ),
        "busy thread in this process (GIL shared), switch interval 50 us": lambda: with_thread(
            5e-5
        ),
        "busy separate process (no shared GIL)": with_process,
    }
    results: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(a.rounds):
        for name, case in cases.items():
            results[name].append(case())
    base = statistics.median(results["alone"])
    lines = [
        *header("Decode step beside other Python work", "interference_bench", argv),
        f"- `{a.preset}` preset, fp32, batch 1, {a.tokens} greedy tokens, {torch.get_num_threads()}"
        f" torch thread(s); the busy work runs {a.busy_ms} ms of every {a.period_ms} ms; "
        f"medians of {a.rounds} interleaved rounds",
        "",
        "| beside | step (ms) | added (ms) |",
        "|---|---|---|",
    ]
    for name, times in results.items():
        med = statistics.median(times)
        lines.append(f"| {name} | {med:.1f} | {med - base:+.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
