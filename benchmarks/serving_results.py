"""What the serving benchmark measured, and the paired quantities read off it."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.serving_config import ServingBenchConfig
from cluster.serving.app_config import AppConfig


@dataclass
class Results:
    cfg: ServingBenchConfig
    app: AppConfig
    inproc_s: list[float] = field(default_factory=list)  # per token, one value per run
    inproc_cpu_s: list[float] = field(default_factory=list)  # CPU per token, one per run
    served_s: dict[str, list[float]] = field(default_factory=dict)  # mode -> per token per run
    # mode -> per token per run of the mode's replica engine alone (`time_decode`), each run
    # next to a served one
    alone_s: dict[str, list[float]] = field(default_factory=dict)
    alone_cpu_s: dict[str, list[float]] = field(default_factory=dict)  # its thread CPU time
    # mode -> per served run: the decoding engine thread's (on CPU, waiting for a CPU, off CPU
    # otherwise) seconds per output token over tokens 2..N
    engine_thread_s: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    # mode -> per served run: the engine thread's CPU seconds per output token outside
    # `Engine.step` (its loop's own work: commands, the KV import, handing outputs on)
    loop_cpu_s: dict[str, list[float]] = field(default_factory=dict)
    # mode -> process -> CPU seconds per output token, one value per run
    served_cpu_s: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # the same over the run of its replica's engine alone next to it (the processes' CPU when
    # the serving path is idle: the pairs' difference is what serving costs each of them)
    alone_proc_cpu_s: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    incl_transfer_s: list[float] = field(default_factory=list)  # (total - TTFT) / (N - 1)
    fetch: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # len -> (B, s)
    ttft: dict[int, list[dict[str, float]]] = field(default_factory=dict)  # len -> timings
    niceness: dict[str, int] = field(default_factory=dict)  # process -> nice
    proxy_env: dict[str, str] | None = None  # node_env of the proxy; None: not found
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    started: str = ""
    elapsed_s: float = 0.0

    def start_mode(self, mode: str) -> None:
        """Empty series for `mode`'s runs (a new measurement of it)."""
        self.served_s[mode], self.served_cpu_s[mode], self.alone_s[mode] = [], {}, []
        self.alone_cpu_s[mode], self.engine_thread_s[mode], self.loop_cpu_s[mode] = [], [], []
        self.alone_proc_cpu_s[mode] = {}


def thread_modes(res: Results) -> list[str]:
    """The modes whose every served run has the engine thread's accounting."""
    return [
        m
        for m, runs in res.engine_thread_s.items()
        if runs and len(runs) == len(res.alone_s[m]) == len(res.loop_cpu_s[m])
    ]


def lost_by_engine(res: Results, mode: str) -> list[float]:
    """Per pair: what serving cost the decoding engine thread per token, from its own
    accounting: its time off CPU beyond that of the same engine alone, plus its loop's CPU
    work outside `Engine.step`. Leaves out the step's own CPU time, the same code in both,
    whose paired difference is dominated by the machine's speed changing between the runs."""
    return [
        (waiting + other) - (wall - cpu) + loop
        for (_, waiting, other), wall, cpu, loop in zip(
            res.engine_thread_s[mode],
            res.alone_s[mode],
            res.alone_cpu_s[mode],
            res.loop_cpu_s[mode],
            strict=True,
        )
    ]
