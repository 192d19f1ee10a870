"""The capacity benchmark's measurements and its Markdown report: one table per path (Serve's
proxy, the router's own endpoint), one column per number of streams, and the targets."""

from __future__ import annotations

import argparse
import math
from dataclasses import astuple, dataclass

from benchmarks.report import header
from benchmarks.stream_load import LoadResult
from cluster.serving.cpu_affinity import format_cpu_list

PATHS = ("proxy", "direct")
PATH_TITLES = {
    "proxy": "through Serve's gRPC proxy",
    "direct": "straight to the router's own gRPC endpoint (no proxy)",
}
PROCESSES = ("proxy", "Router", "Decode", "Prefill", "client")
ENGINES = {  # the decode engine of a table: its title's end
    "model": "",
    "paced": ", emulated GPU engine ({:g} ms a step, no CPU)",
}
TARGET_PATH_US = 100.0  # proxy + router CPU per delivered token
TARGET_RATIO = 0.8  # delivered / engine alone
TARGET_STREAMS = 64


@dataclass(frozen=True)
class AloneRun:
    """The engine alone on one batch: tok/s, the time until every request had its first
    decoded token (its prefill steps and one step) and the median step after that."""

    tok_per_s: float
    ramp_s: float
    step_s: float

    def mean(self, other: AloneRun) -> AloneRun:
        return AloneRun(*((a + b) / 2 for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass(frozen=True)
class Point:
    """One N by one path: the served load, the engine alone on the same requests and the CPU
    seconds of each process during the served run (the load client's process as "client")."""

    streams: int
    path: str
    load: LoadResult
    alone: AloneRun
    cpu_s: dict[str, float]
    engine: str = "model"  # "model": the tiny model; "paced": the emulated GPU engine
    interval: int = 1  # the requests' stream_interval
    ratios: tuple[float, ...] = ()  # delivered / engine alone of every run of this point

    def us_per_token(self, process: str) -> float:
        return 1e6 * self.cpu_s.get(process, math.nan) / self.load.tokens

    def us_per_message(self, process: str) -> float:
        return 1e6 * self.cpu_s.get(process, math.nan) / self.load.messages

    @property
    def path_us(self) -> float:
        """Proxy + router CPU per delivered token."""
        return self.us_per_token("proxy") + self.us_per_token("Router")

    @property
    def alone_tok_s(self) -> float:
        return self.alone.tok_per_s

    @property
    def ratio(self) -> float:
        return self.load.tok_per_s / self.alone_tok_s


def _row(label: str, points: list[Point], cell) -> str:
    return f"| {label} | " + " | ".join(cell(p) for p in points) + " |"


def _ms(p50: float, p99: float) -> str:
    return f"{1e3 * p50:,.1f} / {1e3 * p99:,.1f}"


def table(points: list[Point]) -> list[str]:
    """One path's figures, a column per N."""
    lines = [
        "| streams (N) | " + " | ".join(str(p.streams) for p in points) + " |",
        "|---|" + "---|" * len(points),
        _row("delivered tok/s", points, lambda p: f"{p.load.tok_per_s:,.0f}"),
        _row("engine alone tok/s", points, lambda p: f"{p.alone_tok_s:,.0f}"),
        _row("delivered / engine alone", points, lambda p: f"{p.ratio:.2f}"),
        _row("delivered / engine alone, every run", points, _ratios),
        _row("tokens per message", points, lambda p: f"{p.load.tokens / p.load.messages:.2f}"),
        _row("**proxy + router CPU µs / token**", points, lambda p: f"**{p.path_us:,.0f}**"),
    ]
    for process in PROCESSES:
        label = process if process != "client" else "client (own process, uvloop)"
        lines.append(_row(f"{label} CPU µs / token", points, _us(process)))
    lines += [
        _row("proxy, router CPU µs / message", points, _per_message),
        _row("TTFT p50 / p99 (ms)", points, lambda p: _ms(p.load.ttft(0.5), p.load.ttft(0.99))),
        _row("ITL p50 / p99 (ms)", points, lambda p: _ms(p.load.itl(0.5), p.load.itl(0.99))),
        _row("every stream decoding after (ms), served / alone", points, _ramp),
        _row("step once all decode (ms), served ITL p50 / alone", points, _step),
    ]
    return lines


def _ratios(p: Point) -> str:
    return ", ".join(f"{r:.2f}" for r in p.ratios) or f"{p.ratio:.2f}"


def _ramp(p: Point) -> str:
    return f"{1e3 * p.load.all_decoding_s():,.0f} / {1e3 * p.alone.ramp_s:,.0f}"


def _step(p: Point) -> str:
    return f"{1e3 * p.load.steady_itl():,.2f} / {1e3 * p.alone.step_s:,.2f}"


def _us(process: str):
    return lambda p: f"{p.us_per_token(process):,.0f}"


def _per_message(p: Point) -> str:
    return f"{p.us_per_message('proxy'):,.0f}, {p.us_per_message('Router'):,.0f}"


def verdicts(points: list[Point]) -> list[str]:
    lines = []
    for p in points:
        if p.streams != TARGET_STREAMS:
            continue
        what = p.path if p.engine == "model" else f"{p.path} (emulated GPU engine)"
        if p.interval > 1:
            what += f", stream_interval {p.interval}"
        lines += [
            f"- {what}, N = {TARGET_STREAMS}: proxy + router {p.path_us:,.0f} µs CPU per "
            f"delivered token, target ≤ {TARGET_PATH_US:.0f}: "
            f"**{'PASS' if p.path_us <= TARGET_PATH_US else 'FAIL'}**",
            f"- {what}, N = {TARGET_STREAMS}: delivered {p.ratio:.2f}x the engine alone"
            f"{_median_of(p)}, target ≥ {TARGET_RATIO}x: "
            f"**{'PASS' if p.ratio >= TARGET_RATIO else 'FAIL'}**",
        ]
    return lines or [f"(no N = {TARGET_STREAMS} run: targets not checked)"]


def _median_of(p: Point) -> str:
    return f" (median of {len(p.ratios)} runs: {_ratios(p)})" if len(p.ratios) > 1 else ""


def _pinning(a: argparse.Namespace) -> str:
    if a.engine_cpus:
        cores = format_cpu_list(a.engine_cpus)
        return f"engine threads on core(s) {cores}, everything else on the others"
    if a.decode_engine_cpus:
        cores = format_cpu_list(a.decode_engine_cpus)
        return f"the decode engine thread on core(s) {cores}, every other thread anywhere"
    return "engine threads unpinned"


def against_before(rev: str, before: list[dict], points: list[Point]) -> list[str]:
    """Each (N, path) measured on both: the revision's figures beside this tree's."""
    lines = []
    for then in before:
        now = next(
            (
                p
                for p in points
                if (p.streams, p.path, p.engine, p.interval)
                == (then["streams"], then["path"], "model", 1)
            ),
            None,
        )
        if now is None:
            continue
        rows = [
            ("ITL p50 (ms)", 1e3 * then["itl_p50"], 1e3 * now.load.itl(0.5), ".2f"),
            ("ITL p99 (ms)", 1e3 * then["itl_p99"], 1e3 * now.load.itl(0.99), ".2f"),
            ("TTFT (ms)", 1e3 * then["ttft_p50"], 1e3 * now.load.ttft(0.5), ".1f"),
            ("delivered tok/s", then["tok_s"], now.load.tok_per_s, ",.0f"),
            ("delivered / engine alone", then["ratio"], now.ratio, ".2f"),
            ("proxy + router CPU µs / token", then["path_us"], now.path_us, ",.0f"),
        ]
        title = f"N = {now.streams}, {PATH_TITLES[now.path].split(' (')[0]}"
        lines += ["", f"| {title} | {rev} (before) | this tree |", "|---|---|---|"]
        lines += [f"| {label} | {b:{fmt}} | {n:{fmt}} |" for label, b, n, fmt in rows]
    return lines[1:] or [f"(no point measured on both {rev} and this tree)"]


def render(
    a: argparse.Namespace,
    argv,
    points: list[Point],
    idle,
    transport: str,
    wall: float,
    before: list[dict] | None = None,
) -> str:
    lines = header("Capacity: concurrent streams through proxy + router", "capacity_bench", argv)
    lines += [
        f"- app: 1 router, 1 prefill, 1 decode replica ({a.preset} preset, fp32 CPU, "
        f"{a.threads} torch thread(s) per engine, {_pinning(a)}, KV over "
        f"{transport}); {a.prompt_tokens}-token prompts, {a.tokens} tokens out per stream, "
        f"greedy, EOS ignored; wall time {wall:.0f} s",
        "- idle CPU of each process, ms per second (counted in the figures): "
        + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(idle.items())),
        "- ITL: the gap between two messages, shared by the tokens of the later one",
        "- where the wall goes: the burst's ramp (until every stream has its first decoded "
        "token, from the burst; the engine alone: its prefill steps and one step) and the step "
        "once every stream decodes (served: the ITL p50 of the messages after the ramp)",
    ]
    for engine in ENGINES:
        for path in a.path_names:
            for interval in a.intervals:
                at = [
                    p for p in points if (p.path, p.engine, p.interval) == (path, engine, interval)
                ]
                if not at:
                    continue
                title = f"{path}: {PATH_TITLES[path]}{ENGINES[engine].format(a.gpu_step_ms)}"
                if interval > 1:
                    title += f", stream_interval {interval} (tokens per message after the first)"
                lines += ["", f"## {title}", "", *table(at)]
    if before is not None:
        lines += ["", f"## Against {a.before}", "", *against_before(a.before, before, points)]
    lines += ["", "## Targets", "", *verdicts(points)]
    return "\n".join(lines) + "\n"
