"""The command-line options the benchmarks share: the checkpoint, torch threads, the report
file and, for those that deploy apps, the Serve to use."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from benchmarks.report import add_out_option
from cluster.model.make_model import cached_model

T = TypeVar("T")


def checkpoint_options(p: argparse.ArgumentParser, name: str, preset: str = "small") -> None:
    """--preset, --model-dir and --out (the report of benchmark `name`)."""
    p.add_argument("--preset", default=preset, help=f"make_model preset (default {preset})")
    p.add_argument("--model-dir", default=None, help="checkpoint dir (default: the preset's)")
    add_out_option(p, name)


def common_parser(doc: str | None, name: str) -> argparse.ArgumentParser:
    """The options of the benchmarks that run engines in their own process; their `main`
    runs `publish(with_threads(args.threads, ...), args.out)`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    checkpoint_options(p, name)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    return p


def served_parser(doc: str | None, name: str) -> argparse.ArgumentParser:
    """The options of the benchmarks that deploy apps of their own (`measure_served`)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    checkpoint_options(p, name)
    p.add_argument(
        "--grpc-port",
        type=int,
        default=0,
        help="use the Serve already running with this gRPC "
        "port (pdserve's servicer) instead of starting a local Ray",
    )
    return p


def model_dir(a: argparse.Namespace) -> Path:
    """`--model-dir`, or the preset's checkpoint in the cache (built on first use)."""
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
