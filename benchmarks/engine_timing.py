"""Time an engine alone: a batch-1 greedy generation stepped in a plain loop.

The reference the serving benchmark compares served decoding against, run either in the
benchmark's own process or, through `time_decode` of `benchmarks.probed_replicas`, on a
replica's own engine (the same weights in the same memory, with nothing of the serving path
around it).
"""

from __future__ import annotations

import time
import uuid

from cluster.engine.engine import Engine
from cluster.request import Request
from cluster.sampling_params import SamplingParams


def timed_decode(engine: Engine, prompt: list[int], n: int) -> tuple[float, float]:
    """Generate `n` tokens of `prompt` (greedy, ignore_eos) by calling `engine.step()` until
    done; return (seconds, CPU seconds of this thread) per output token over tokens 2..N, so
    the prefill is not in it. The engine must have no other work (its outputs would be lost)."""
    if n < 3:
        raise ValueError("timing needs at least 3 output tokens")
    rid = f"timed-{uuid.uuid4().hex}"
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    engine.add_request(Request(rid, tuple(prompt), params))
    times: list[float] = []
    cpu: list[float] = []
    try:
        while engine.has_work():
            for out in engine.step():
                now, now_cpu = time.perf_counter(), time.thread_time()
                times.extend(now for _ in out.token_ids)
                cpu.extend(now_cpu for _ in out.token_ids)
    finally:
        if rid in engine.seqs:  # a failed step: leave no blocks behind
            engine.abort(rid)
    if len(times) != n:
        raise RuntimeError(f"timed run made {len(times)} tokens, not {n}")
    return per_token(times), per_token(cpu)


def per_token(marks: list[float]) -> float:
    """Mean decode step from the times of output tokens 2..N (token 1 is the prefill's; when
    served disaggregated, the gap to token 2 holds the KV transfer)."""
    return (marks[-1] - marks[1]) / (len(marks) - 2)
