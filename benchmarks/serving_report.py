"""The serving benchmark's Markdown report: the setup, section 1 (decode latency served against
the engine alone), 2 (KV fetch throughput), 3 (KV transfer as a share of TTFT) and the
targets."""

from __future__ import annotations

import os

import grpc

from benchmarks.paired_stats import bounded_verdict, med, median_ci, spread
from benchmarks.report import device_name, header
from benchmarks.serve_session import kv_transport
from benchmarks.serving_config import (
    ADDED_LATENCY_TARGET_S,
    LABELS,
    TRANSFER_SHARE_TARGET,
    TTFT_TOKENS,
    ServingBenchConfig,
)
from benchmarks.serving_results import Results, lost_by_engine, thread_modes
from benchmarks.serving_tables import cpu_table, engine_thread_table
from cluster.serving.cpu_affinity import format_cpu_list

ROWS = (
    "decode per token, in-process Engine.step",
    "disaggregated (total - TTFT) / (N - 1), incl. KV transfer",
)


def render(res: Results, argv: list[str]) -> str:
    cfg = res.cfg
    title = f"pdserve serving benchmark ({cfg.preset} model)"
    lines = [*header(title, "serving_bench", argv, cfg.device), *_setup(res)]
    lines += _decode_section(res)
    lines += cpu_table(res)
    lines += engine_thread_table(res)
    lines += _fetch_section(res)
    section3, shares = _ttft_section(res)
    lines += section3
    lines += _targets(res, shares)
    return "\n".join(lines) + "\n"


def _setup(res: Results) -> list[str]:
    import ray

    cfg, app = res.cfg, res.app
    nice = ", ".join(f"{k} {v}" for k, v in res.niceness.items()) or "not read"
    return [
        f"- started: {res.started}; wall time {res.elapsed_s:.0f} s; ray {ray.__version__}, "
        f"grpcio {grpc.__version__}",
        f"- load average before: {_load(res.load_before)}; after: {_load(res.load_after)}",
        f"- config: checkpoint `{cfg.model_dir.name}`, {cfg.dtype} on {cfg.device} "
        f"({device_name(cfg.device)}); 1 router + 1 prefill + "
        f"1 decode replica (colocated app: 1 router + 1 colocated replica); tokens reach the "
        f"router over the direct token stream; "
        f"{cfg.replica_cpus} Ray CPUs and {cfg.torch_threads} torch thread(s) per engine replica; "
        f"the in-process baseline uses the same engine config and "
        f"{cfg.torch_threads} torch thread(s); KV pool {app.decode.cache.num_blocks} blocks x "
        f"{cfg.block_size} tokens per replica; scheduler token budget {cfg.chunk_tokens} per "
        f"step (a {max(cfg.long_prompts)}-token prompt prefills in "
        f"{-(-max(cfg.long_prompts) // cfg.chunk_tokens)} chunks); KV transport "
        f"{kv_transport(app)} (section 2 fetches over grpc), chunks of at most "
        f"{cfg.max_chunk_bytes} bytes; {cfg.repeats} repeats, medians reported",
        f"- CPU priority (nice): {nice}",
        f"- proxy to router: {proxy_transport(res.proxy_env)}",
        f"- cores: {cores(cfg)}",
    ]


def _decode_section(res: Results) -> list[str]:
    cfg = res.cfg
    lines = [
        "",
        f"## 1. Decode latency per output token (batch 1, greedy, ignore_eos, {cfg.short_prompt}-"
        f"token prompt, N = {cfg.decode_tokens})",
        "",
        "Per run: mean step over output tokens 2..N (client-side message arrival times when "
        "served), so neither prefill nor KV transfer is included. Two references: the decoding "
        "replica's own engine alone (`time_decode`: the same engine, weights and process, "
        "stepped in a plain loop with nothing of the serving path around it, run next to each "
        "served run), and an engine of the same config in this process (interleaved, the order "
        "rotated every repeat). Added = median of the paired (served − reference) differences. "
        "Two engines of one config differ by themselves (where their weights landed in memory), "
        "so the second reference carries that difference too: its row \"this process's engine "
        "− the replica's engine\" shows it.",
        "",
        "| metric | median (ms) | runs min–max (ms) |",
        "|---|---|---|",
        _row(ROWS[0], res.inproc_s),
    ]
    for mode, xs in res.served_s.items():
        if xs:
            lines += _mode_rows(res, mode, xs)
    lines.append(_row(ROWS[1], res.incl_transfer_s))
    return lines


def _mode_rows(res: Results, mode: str, xs: list[float]) -> list[str]:
    base, alone, label = res.inproc_s, res.alone_s[mode], LABELS[mode]
    return [
        _row(f"decode per token, {label}, via Serve + gRPC", xs),
        _row(f"decode per token, {label}: its replica's engine alone", alone),
        _row(f"added per token, {label}, vs its replica's engine alone", _diff(xs, alone), "+"),
        _row(f"added per token, {label}", _diff(xs, base), "+"),
        _row(
            f"this process's engine − the {label} replica's engine, both alone",
            _diff(base, alone),
            "+",
        ),
    ]


def _row(label: str, xs: list[float], sign: str = "") -> str:
    return f"| {label} | {med(xs) * 1e3:{sign}.2f} | {spread(xs)} |"


def _diff(xs: list[float], ys: list[float]) -> list[float]:
    return [x - y for x, y in zip(xs, ys, strict=True)]


def _fetch_section(res: Results) -> list[str]:
    lines = [
        "",
        "## 2. KV transfer throughput (grpc, loopback, fetched by this process)",
        "",
        f"`GrpcKVClient.fetch` of a prompt's KV held by the prefill replica; {res.cfg.fetches} "
        "timed fetches of the same lease after one warm-up; bytes = assembled K + V `nbytes`.",
        "",
        "| prompt tokens | KV bytes (MB) | fetch median (ms) | KV fetch throughput (GB/s) |",
        "|---|---|---|---|",
    ]
    for n_tok, fs in res.fetch.items():
        nbytes = fs[0][0]
        sec = med([s for _, s in fs])
        gbs = med([b / s / 1e9 for b, s in fs])
        lines.append(f"| {n_tok} | {nbytes / 1e6:.1f} | {sec * 1e3:.1f} | {gbs:.2f} |")
    return lines


def _ttft_section(res: Results) -> tuple[list[str], dict[int, tuple[float, float]]]:
    """Section 3's lines, and per prompt length the KV transfer's share of TTFT and of
    TTFT + transfer."""
    lines = [
        "",
        f"## 3. KV transfer as a share of TTFT (disaggregated, {TTFT_TOKENS} output tokens)",
        "",
        "From the final message's `timing`: `kv_transfer_seconds` is measured by the decode "
        "worker from before `GrpcKVClient.fetch` until the KV is imported into its engine, so it "
        "covers the fetch, the wait for the engine thread and the copy into the decode pool "
        "(the ReleaseKV call runs during the copy). The transfer starts after the first token "
        "was streamed, so it is not inside TTFT; the conservative share divides by TTFT + "
        "transfer. Client TTFT is from the call to the first message; the 1st→2nd token gap is "
        "what the client sees of the transfer (plus the decode hop and one decode step). Every "
        f"run sends a prompt of its own, so none is served from the prefix cache. Medians of "
        f"{res.cfg.ttft_runs} runs per length after a warm-up.",
        "",
        "| prompt tokens | client TTFT (ms) | server TTFT (ms) | prefill (ms) | KV transfer (ms) "
        "| 1st→2nd token gap (ms) | KV transfer / TTFT | KV transfer / (TTFT + transfer) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    shares: dict[int, tuple[float, float]] = {}
    for n_tok, rows in res.ttft.items():
        m = {key: med([r[key] for r in rows]) * 1e3 for key in rows[0]}
        share = med([r["transfer"] / r["ttft"] for r in rows])
        cons = med([r["transfer"] / (r["ttft"] + r["transfer"]) for r in rows])
        shares[n_tok] = (share, cons)
        lines.append(
            f"| {n_tok} | {m['client_ttft']:.1f} | {m['ttft']:.1f} | {m['prefill']:.1f} | "
            f"{m['transfer']:.1f} | {m['gap2']:.1f} | {share:.1%} | {cons:.1%} |"
        )
    return lines, shares


def _targets(res: Results, shares: dict[int, tuple[float, float]]) -> list[str]:
    lines = ["", "## Targets", "", "| target | measured | result |", "|---|---|---|"]
    for mode, xs in res.served_s.items():
        if not xs:
            continue
        for reference, ref in (
            ("its replica's engine alone", res.alone_s[mode]),
            ("an engine in this process", res.inproc_s),
        ):
            what = f"added latency per output token, {mode}, vs {reference}"
            lines.append(_latency_target(what, _diff(xs, ref)))
    for mode in thread_modes(res):
        what = (
            f"serving's cost to the {mode} engine thread per output token (off CPU + loop "
            "work; Engine.step's own CPU time taken as equal)"
        )
        lines.append(_latency_target(what, lost_by_engine(res, mode)))
    for n_tok, (share, cons) in shares.items():
        lines += [
            f"| KV transfer ≤ {TRANSFER_SHARE_TARGET:.0%} of TTFT, {n_tok}-token prompt "
            f"| {share:.1%} | {_verdict(share <= TRANSFER_SHARE_TARGET)} |",
            f"| KV transfer ≤ {TRANSFER_SHARE_TARGET:.0%} of (TTFT + transfer), {n_tok}-token "
            f"prompt (conservative) | {cons:.1%} | {_verdict(cons <= TRANSFER_SHARE_TARGET)} |",
        ]
    longest = max(res.cfg.long_prompts)
    return lines + [
        "",
        "An added-latency target is PASS when the whole confidence interval of the median "
        "paired difference (distribution-free, from the order statistics) is at or under it, "
        "FAIL when all of it is above, NOT SHOWN when it straddles the target: then this "
        "machine's run-to-run noise is larger than the distance to the target, and more "
        "repeats (or a quieter machine) are needed to tell.",
        "",
        "The presets' max_position_embeddings is 2048 and the context counts generated tokens: "
        "a 2047-token prompt finishes on the prefill's token (length) and moves no KV, so the "
        f'"2048-token" case uses {longest} prompt tokens '
        f"({-(-longest // res.cfg.block_size)} KV blocks, as for 2048).",
    ]


def _latency_target(what: str, diffs: list[float]) -> str:
    """A Targets row for per-token paired differences against ADDED_LATENCY_TARGET_S."""
    low, high, coverage = median_ci(diffs)
    return (
        f"| {what} ≤ {ADDED_LATENCY_TARGET_S * 1e3:.0f} ms | {med(diffs) * 1e3:+.2f} ms "
        f"({coverage:.0%} CI of the median {low * 1e3:+.2f} to {high * 1e3:+.2f}, "
        f"{len(diffs)} pairs) | {bounded_verdict(low, high, ADDED_LATENCY_TARGET_S)} |"
    )


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def cores(cfg: ServingBenchConfig) -> str:
    """Where the engine threads and everything else may run."""
    if not cfg.engine_cpus:
        return "not pinned: every process may run on every core"
    engine = format_cpu_list(cfg.engine_cpus)
    rest = format_cpu_list(set(range(os.cpu_count() or 1)) - set(cfg.engine_cpus))
    return (
        f"engine threads (replicas' and the in-process baseline's) on {engine} "
        f"(`engine_cpus`); Ray's processes, the proxies, the router and this client on {rest}"
    )


def proxy_transport(env: dict[str, str] | None) -> str:
    if env is None:
        return "not read (this script did not start the Ray it uses)"
    if env.get("RAY_SERVE_PROXY_USE_GRPC") == "1":
        return "over gRPC to the router's replica (RAY_SERVE_PROXY_USE_GRPC=1 in the proxy)"
    return "Ray actor calls (RAY_SERVE_PROXY_USE_GRPC not 1 in the proxy)"


def _load(x: tuple[float, float, float]) -> str:
    return " ".join(f"{v:.2f}" for v in x) + " (1, 5, 15 min)"
