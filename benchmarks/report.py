"""What every benchmark report starts with, and where it goes.

Each benchmark keeps one current report, `benchmarks/results/<name>.md`: its script's `--out`
defaults to it, so a run overwrites it (the history is git's). `--out -` only prints. The
header names the date, the commit the code was at, the machine and the exact command.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]


def result_path(name: str) -> Path:
    """The current report of benchmark `name`."""
    return RESULTS / f"{name}.md"


def add_out_option(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument(
        "--out",
        default=str(result_path(name)),
        help=f"write the Markdown report here too (default: benchmarks/results/{name}.md; "
        "'-': only print it)",
    )


def header(title: str, script: str, argv: list[str], device: str = "cpu") -> list[str]:
    """The report's title and its date, commit, machine and command lines."""
    command = f"python -m benchmarks.{script} {' '.join(argv)}".rstrip()
    return [
        f"# {title}",
        "",
        f"- date: {datetime.now(UTC).isoformat(timespec='seconds')}",
        f"- commit: {commit()}",
        f"- machine: {machine(device)}; load average {_load()} (1, 5, 15 min) as the "
        "report was written",
        f"- command: `{command}`",
    ]


def commit() -> str:
    """HEAD's short hash, and whether tracked files differed from it; $PDSERVE_COMMIT where
    there is no .git (a `git archive` copy on a lent machine). Read-only: optional locks off,
    so a concurrent git command never finds the index locked by this."""
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
    return f"{head}" + (" with uncommitted changes" if dirty else "")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine(device: str = "cpu") -> str:
    """CPUs, OS, Python and torch, and the accelerator when `device` is one."""
    gpu = f"; {device_name(device)}" if device.startswith("cuda") else ""
    return (
        f"{os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}{gpu}"
    )


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


def publish(report: str, out: str | Path | None) -> str:
    """Print a report and, unless `out` is None or '-', write it there too."""
    print(report)
    if out is not None and str(out) != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(report, "utf-8")
    return report


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
