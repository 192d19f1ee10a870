"""Plain versus packed fp32 linear layers, by row count: what decides
`cluster.model.linear.PACKED_ROWS`.

    python -m benchmarks.linear_bench [--preset small] [--rows 1,2,4,...] [--out FILE]

Loads the checkpoint with packed weights and, for each row count, times every linear layer of
the model once in order (one step's worth of GEMMs, each weight read from memory, not from a
warm cache), through `F.linear` on the plain weight and through the packed weight, interleaved
run by run; prints the medians side by side and the packed copy's resident memory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.options import common_parser, model_dir, with_threads
from benchmarks.report import header, publish
from cluster.config import ModelConfig
from cluster.model.linear import PACKED_ROWS, Linear, pack_linears
from cluster.model.loader import load_model

DEFAULT_ROWS = "1,2,3,4,8,16,32,48,64,96,128,256,512"


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = common_parser(__doc__, "linear")
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args(argv)
    return publish(with_threads(a.threads, lambda: measure(a, argv)), a.out)


def measure(a: argparse.Namespace, argv: list[str]) -> str:
    before = _resident_bytes()
    model = load_model(ModelConfig(str(model_dir(a)), packed_weights=False)).model
    plain_bytes = _resident_bytes() - before
    before = _resident_bytes()
    if pack_linears(model) == 0:
        sys.exit("packed GEMM unavailable on this machine (see the log)")
    packed_bytes = _resident_bytes() - before
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    lines = [
        *header("Plain vs packed fp32 linear layers", "linear_bench", argv),
        f"- {torch.get_num_threads()} torch thread(s)",
        f"- model: `{a.preset}` preset, {len(layers)} linear layers; resident memory of the "
        f"loaded model {plain_bytes / 1e6:.0f} MB, of the packed copies "
        f"{packed_bytes / 1e6:.0f} MB",
        f"- per row count: every linear layer once, in model order; median of {a.repeats} "
        "interleaved runs; `PACKED_ROWS` (where the model uses the packed weight) is "
        f"{PACKED_ROWS.start}-{PACKED_ROWS.stop - 1}",
        "",
        "| rows | plain (ms) | packed (ms) | packed / plain |",
        "|---|---|---|---|",
    ]
    with torch.inference_mode():
        for rows in (int(r) for r in a.rows.split(",")):
            inputs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}

            def plain(inputs=inputs) -> None:
                for m in layers:
                    F.linear(inputs[m.in_features], m.weight, m.bias)

            def packed(inputs=inputs) -> None:
                for m in layers:
                    m.packed(inputs[m.in_features], m.bias)

            times: dict[str, list[float]] = {"plain": [], "packed": []}
            plain(), packed()
            for _ in range(a.repeats):
                for name, fn in (("plain", plain), ("packed", packed)):
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            pl, pk = (statistics.median(times[n]) * 1e3 for n in ("plain", "packed"))
            lines.append(f"| {rows} | {pl:.1f} | {pk:.1f} | {pk / pl:.2f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
