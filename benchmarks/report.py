"""The benchmarks' shared plumbing: the options every script has, what a report starts with and
where it goes, and the paired statistics a target is judged by.

Each benchmark keeps one current report, `benchmarks/results/<name>.md`: its `--out` defaults
to it, so a run overwrites it (the history is git's); `--out -` only prints. The header names
the date, the commit the code was at, the machine and the exact command.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import torch

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]
T = TypeVar("T")


def parser(doc: str | None, name: str, preset: str = "small") -> argparse.ArgumentParser:
    """--preset, --model-dir and --out (the report of benchmark `name`)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default=preset, help=f"make_model preset (default {preset})")
    p.add_argument("--model-dir", default=None, help="checkpoint dir (default: the preset's)")
    add_out_option(p, name)
    return p


def add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")


def served_parser(doc: str | None, name: str, preset: str = "small") -> argparse.ArgumentParser:
    """`parser` and --grpc-port, for the benchmarks that deploy apps of their own."""
    p = parser(doc, name, preset)
    use = "use the Serve already running in this process's Ray, its gRPC proxy on this port, "
    p.add_argument("--grpc-port", type=int, default=0, help=use + "instead of starting a local Ray")
    return p


def add_out_option(p: argparse.ArgumentParser, name: str) -> None:
    to = f"write the Markdown report here too (default: benchmarks/results/{name}.md; '-': "
    p.add_argument("--out", default=str(RESULTS / f"{name}.md"), help=to + "only print it)")


def model_dir(a: argparse.Namespace) -> Path:
    """`--model-dir`, or the preset's checkpoint in the cache (built on first use)."""
    from cluster.model.make_model import cached_model

    if a.model_dir:
        return Path(a.model_dir).expanduser().absolute()
    return cached_model(a.preset)


def with_threads(threads: int, make_report: Callable[[], T]) -> T:
    """`make_report()` with `threads` torch threads (0: as they are), restored afterwards."""
    before = torch.get_num_threads()
    try:
        if threads > 0:
            torch.set_num_threads(threads)
        return make_report()
    finally:
        torch.set_num_threads(before)


def header(title: str, script: str, argv: list[str], device: str = "cpu") -> list[str]:
    """The report's title and its date, commit, machine and command lines."""
    command = f"python -m benchmarks.{script} {' '.join(argv)}".rstrip()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"# {title}",
        "",
        f"- date: {datetime.now(UTC).isoformat(timespec='seconds')}",
        f"- commit: {commit()}",
        f"- machine: {machine(device)}; load average {load} (1, 5, 15 min) as the report "
        "was written",
        f"- command: `{command}`",
    ]


def commit() -> str:
    """HEAD's short hash, and whether tracked files differed from it; $PDSERVE_COMMIT where
    there is no .git. Read-only (optional locks off): a concurrent git never finds the index
    locked by this."""
    if os.environ.get("PDSERVE_COMMIT"):
        return os.environ["PDSERVE_COMMIT"]
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head + (" with uncommitted changes" if dirty else "")


def machine(device: str = "cpu") -> str:
    """CPUs, OS, Python and torch, and the accelerator when `device` is one."""
    cpu = platform.processor() or "unknown"
    if Path("/proc/cpuinfo").exists():
        names = [x for x in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in x]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    gpu = f"; {device_name(device)}" if device.startswith("cuda") else ""
    return (
        f"{os.cpu_count()} CPUs ({cpu}), {platform.platform()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}{gpu}"
    )


def device_name(device: str) -> str:
    return f"GPU {torch.cuda.get_device_name(device)}" if device.startswith("cuda") else "CPU"


def publish(report: str, out: str | Path | None) -> str:
    """Print a report and, unless `out` is None or '-', write it there too."""
    print(report)
    if out is not None and str(out) != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(report, "utf-8")
    return report


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free confidence interval for the median of `xs`: the order statistics
    x(k) and x(n+1-k) for the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k), is
    still at least `level`. Returns (low, high, coverage); with too few values for `level`
    it is (min, max) and the smaller coverage those have."""
    ys = sorted(xs)
    n = len(ys)
    k, coverage = 1, 1.0 - 2.0 * 0.5**n
    while k + 1 <= n // 2:
        below = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n  # P(B <= k)
        if 1.0 - 2.0 * below < level:
            break
        k, coverage = k + 1, 1.0 - 2.0 * below
    return ys[k - 1], ys[n - k], coverage


def bounded_verdict(low: float, high: float, target: float) -> str:
    """PASS when the whole interval is within the target, FAIL when none of it is, else the
    runs do not tell (the machine's noise is larger than the distance to the target)."""
    if high <= target:
        return "PASS"
    if low > target:
        return "FAIL"
    return "NOT SHOWN"
