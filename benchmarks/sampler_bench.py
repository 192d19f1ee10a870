"""The sampler's cost per step for sampled rows, against another revision's sampler.

    python -m benchmarks.sampler_bench [--before REV] [--rows 1,8,32] [--vocab 49152]
        [--device cpu|cuda] [--out FILE]

For each row count and setting (temperature alone, top-k 50, top-p 0.9, both, and a mixed
batch of greedy, top-k, top-p, min-p and penalised rows), one `Sampler()` call over random
[rows, vocab] float32 logits (times 3, a peaked distribution): its time (best of `--repeats`,
interleaved between the two samplers; on a GPU synchronised) and the ops it dispatches that
read a device value back to the host (`benchmarks.launch_count.HOST_SYNCS`, counted on any
device: a sync each on a GPU). `--before` loads `cluster/engine/sampler.py` as it was at REV
(`git show`) beside this tree's; it must take the same arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks.launch_count import HOST_SYNCS, counting
from benchmarks.report import REPO, add_out_option, header, publish
from cluster.engine.sampler import Sampler
from cluster.sampling_params import SamplingParams

SETTINGS = {
    "temperature 0.8": [SamplingParams(temperature=0.8)],
    "top-k 50": [SamplingParams(temperature=0.8, top_k=50)],
    "top-p 0.9": [SamplingParams(temperature=0.8, top_p=0.9)],
    "top-k 50 + top-p 0.9": [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)],
    "mixed": [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.95),
        SamplingParams(temperature=0.7, min_p=0.05),
        SamplingParams(temperature=0.9, repetition_penalty=1.2),
    ],
}


def revision_sampler(rev: str) -> type:
    """`Sampler` of cluster/engine/sampler.py at `rev` (it imports this tree's other modules)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:cluster/engine/sampler.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"sampler_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Sampler


def sample(sampler: type, args: tuple) -> list[int]:
    return sampler()(*args)


def timed(call: Callable[[], object], device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    began = time.perf_counter()
    call()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - began


def syncs(call: Callable[[], object]) -> int:
    with counting() as counter:
        call()
    return sum(n for op, n in counter.ops.items() if op in HOST_SYNCS)


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", default=None, help="a git revision whose sampler runs beside")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--vocab", type=int, default=49152, help="default: the presets' vocabulary")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    add_out_option(p, "sampler")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    systems = {"this tree": Sampler}
    if a.before:
        systems = {a.before: revision_sampler(a.before), **systems}
    names = list(systems)
    lines = [
        *header("Sampler: sampled rows per step", "sampler_bench", argv, a.device),
        f"- {a.vocab}-token vocabulary, float32 logits on {a.device}, {a.threads} torch "
        f"thread(s); best of {a.repeats} interleaved calls",
        "",
        "| rows | setting | "
        + " | ".join(f"{n}: ms, host syncs" for n in names)
        + (" | this tree / before (time) |" if a.before else " |"),
        "|---|---|" + "---|" * (len(names) + bool(a.before)),
    ]
    gen = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in a.rows.split(",")):
        logits = (torch.randn(rows, a.vocab, generator=gen) * 3).to(a.device)
        histories = [[1, 2, 3]] * rows
        for setting, cycle in SETTINGS.items():
            params = [cycle[i % len(cycle)] for i in range(rows)]
            args = (logits, params, list(range(rows)), [3] * rows, histories)
            calls = {n: partial(sample, s, args) for n, s in systems.items()}
            best = {n: min(timed(c, a.device) for _ in range(2)) for n, c in calls.items()}
            for _ in range(a.repeats):
                for n, c in calls.items():
                    best[n] = min(best[n], timed(c, a.device))
            cells = [f"{best[n] * 1e3:.2f}, {syncs(calls[n])}" for n in names]
            ratio = [f"{best['this tree'] / best[a.before]:.2f}"] if a.before else []
            lines.append(f"| {rows} | {setting} | " + " | ".join(cells + ratio) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    return publish("\n".join(lines) + "\n", a.out)


if __name__ == "__main__":
    main()
