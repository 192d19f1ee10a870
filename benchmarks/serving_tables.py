"""Section 1's breakdowns in the serving benchmark's report: CPU time per token by process, and
where the decoding engine thread's time went."""

from __future__ import annotations

import os

from benchmarks.paired_stats import med, ms, with_ci
from benchmarks.serving_config import LABELS
from benchmarks.serving_results import Results, lost_by_engine, thread_modes


def cpu_table(res: Results) -> list[str]:
    """CPU per output token of each process, served and with the serving path idle, and the
    paired difference."""
    modes = [m for m in res.served_cpu_s if res.served_cpu_s[m]]
    if not modes:
        return []
    names = sorted({k.split("/")[-1] for m in modes for k in res.served_cpu_s[m]})
    heads = [h for m in modes for h in (m, f"{m}: engine alone", f"{m}: served − alone")]
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK") / res.cfg.decode_tokens
    lines = [
        "",
        "CPU time per output token by process (ms, median of runs; /proc utime + stime over "
        f"a whole served run, prefill included, divided by N; /proc counts whole ticks, "
        f'{tick_ms:.2f} ms per token here). "engine alone": the same over '
        "the run of the decoding replica's engine alone next to it, when the serving path is "
        "idle (each process's background work: Ray's and Serve's own threads, health checks, "
        'metrics). "served − alone": median of the paired differences, what serving the '
        "tokens cost each process.",
        "",
        "| process | " + " | ".join(heads) + " |",
        "|---|" + "---|" * len(heads),
        "| in-process baseline (engine thread) | "
        + " | ".join(f"{ms(res.inproc_cpu_s)} | | " for _ in modes)
        + "|",
    ]
    for name in names:
        cells = []
        for m in modes:
            served = _by_process(res.served_cpu_s[m], name)
            alone = _by_process(res.alone_proc_cpu_s.get(m, {}), name)
            paired = len(served) == len(alone) > 0
            diff = [a - b for a, b in zip(served, alone, strict=True)] if paired else []
            cells += [ms(served), ms(alone), f"{med(diff) * 1e3:+.2f}" if diff else "–"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _by_process(runs: dict[str, list[float]], name: str) -> list[float]:
    return next((v for k, v in runs.items() if k.split("/")[-1] == name), [])


def engine_thread_table(res: Results) -> list[str]:
    """Where the decoding engine thread's time per token went, served and alone, and the
    paired served − alone differences of its on-CPU and off-CPU parts (their sum is the added
    latency against the replica's engine alone)."""
    modes = thread_modes(res)
    if not modes:
        return []
    lines = [
        "",
        "The decoding replica's engine thread, per output token over tokens 2..N (ms, medians "
        "of runs). Served: its scheduler accounting (/proc/PID/task/TID/schedstat) read by this "
        "client when token 2 and token N arrived, the rest of the client's interval being time "
        "off CPU for other reasons (waiting for the GIL or a lock, or idle). Alone: "
        "`time_decode`'s wall and thread CPU time. The paired differences split the added "
        "latency into time the engine lost off CPU (the serving path taking the GIL or the "
        "core) and the difference in its own CPU time (extra work per step, or the machine "
        "running slower during one run of the pair).",
        "",
        "| engine thread | on CPU | of it outside Engine.step | waiting for a CPU | off CPU "
        "otherwise | off CPU, served − alone (CI) | on CPU, served − alone (CI) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in modes:
        lines += _engine_thread_rows(res, m)
    lines += [
        "",
        "What serving cost the engine thread per token (its extra time off CPU plus its loop's "
        "work outside `Engine.step`, paired per run): "
        + "; ".join(f"{LABELS[m]} {with_ci(lost_by_engine(res, m))} ms" for m in modes)
        + ". This leaves out the one part the pairs cannot measure finely on a machine whose "
        "speed changes from run to run: a difference in the CPU time of `Engine.step` itself "
        "(the same code on the same thread in both runs; the on-CPU column above shows its "
        "paired difference with that noise in it).",
    ]
    return lines


def _engine_thread_rows(res: Results, m: str) -> list[str]:
    runs = res.engine_thread_s[m]
    on_cpu = [r[0] for r in runs]
    off_cpu = [r[1] + r[2] for r in runs]
    alone_off = [w - c for w, c in zip(res.alone_s[m], res.alone_cpu_s[m], strict=True)]
    d_off = [s - a for s, a in zip(off_cpu, alone_off, strict=True)]
    d_on = [s - a for s, a in zip(on_cpu, res.alone_cpu_s[m], strict=True)]
    return [
        f"| {LABELS[m]}, served | {med(on_cpu) * 1e3:.2f} | "
        f"{med(res.loop_cpu_s[m]) * 1e3:.3f} | {med([r[1] for r in runs]) * 1e3:.2f} | "
        f"{med([r[2] for r in runs]) * 1e3:.2f} | {with_ci(d_off)} | {with_ci(d_on)} |",
        f"| {LABELS[m]}, its engine alone | {med(res.alone_cpu_s[m]) * 1e3:.2f} | | "
        f"{med(alone_off) * 1e3:.2f} (both kinds) | | | |",
    ]
