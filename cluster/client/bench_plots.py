"""`write_plots`: a `pdserve bench` run as PNGs, for a reader who wants to see the run rather
than its percentiles: the CDFs of time to first token and inter-token latency, each request's
latencies against the time it was sent, each request's end to end split into the server's
phases (when the server gave them), and the pools' replicas over time (when sampled).

matplotlib is an optional extra (`pip install 'pdserve[plot]'`), imported only here and only
when plotting; `missing_extra` says whether it is there before a run starts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cluster.client.bench_summary import PHASES, phase_seconds
from cluster.client.load_generator import ReplicaSample, RequestRecord

EXTRA_HINT = "--plot needs matplotlib: pip install 'pdserve[plot]'"
SIZE_IN, DPI = (6.4, 3.6), 100


def missing_extra() -> str | None:
    """`EXTRA_HINT` when matplotlib is not installed, else None."""
    return None if importlib.util.find_spec("matplotlib") else EXTRA_HINT


def write_plots(
    records: list[RequestRecord],
    out_dir: str | Path,
    replicas: list[ReplicaSample] | None = None,
    title: str = "pdserve bench",
) -> list[Path]:
    """Write the run's PNGs into `out_dir` (made if missing) and return their paths:
    ttft_cdf.png, itl_cdf.png, latency_over_time.png, then phases.png when any request
    carries the server's timing and replicas.png when `replicas` has samples."""
    import matplotlib

    matplotlib.use("Agg")  # files only, whatever the display
    from matplotlib import pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.ok]
    figures = {
        "ttft_cdf.png": lambda ax: _cdf(ax, [r.ttft_s for r in done], "time to first token"),
        "itl_cdf.png": lambda ax: _cdf(ax, [g for r in done for g in r.itl_s], "inter-token gap"),
        "latency_over_time.png": lambda ax: _over_time(ax, records),
    }
    if any(r.timing is not None for r in done):
        figures["phases.png"] = lambda ax: _phases(ax, done)
    if replicas:
        figures["replicas.png"] = lambda ax: _replicas(ax, replicas)
    paths = []
    for name, draw in figures.items():
        fig, ax = plt.subplots(figsize=SIZE_IN, dpi=DPI)
        draw(ax)
        ax.set_title(f"{title}: {ax.get_title()}", fontsize=10)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        paths.append(out / name)
    return paths


def _cdf(ax, seconds: list[float], what: str) -> None:
    xs = sorted(s * 1e3 for s in seconds)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post")
    ax.set(xlabel=f"{what} (ms)", ylabel="fraction of samples", ylim=(0, 1.02))
    ax.set_title(f"{what}, CDF of {len(xs)}")


def _over_time(ax, records: list[RequestRecord]) -> None:
    done = [r for r in records if r.ok]
    sent = [r.sent_s for r in done]
    ax.scatter(sent, [r.e2e_s * 1e3 for r in done], s=10, label="end to end")
    ax.scatter(sent, [r.ttft_s * 1e3 for r in done], s=10, label="time to first token")
    failed = [r.sent_s for r in records if not r.ok]
    if failed:
        ax.scatter(failed, [0] * len(failed), marker="x", color="red", label="failed")
    ax.set(xlabel="sent at (s from the start)", ylabel="ms")
    ax.legend(fontsize=8)
    ax.set_title("latency by the time each request was sent")


def _phases(ax, done: list[RequestRecord]) -> None:
    timed = [r for r in done if r.timing is not None]
    split = [phase_seconds(r) for r in timed]
    bottom = [0.0] * len(timed)
    for phase in PHASES:
        ms = [p[phase] * 1e3 for p in split]
        ax.bar([r.index for r in timed], ms, bottom=bottom, width=0.9, label=phase)
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    ax.set(xlabel="request (workload order)", ylabel="end to end (ms)")
    ax.legend(fontsize=7, ncols=3)
    ax.set_title("where each request's time went")


def _replicas(ax, samples: list[ReplicaSample]) -> None:
    pools = sorted({p for s in samples for p in s.replicas})
    for pool in pools:
        ax.step(
            [s.t_s for s in samples],
            [s.replicas.get(pool, 0) for s in samples],
            where="post",
            label=pool,
        )
    ax.set(xlabel="s from the start", ylabel="replicas running")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8)
    ax.set_title("replicas per pool")
