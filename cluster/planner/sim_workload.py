"""The simulator's requests: lengths, arrival and the identity of each prompt block, from a
Mooncake-format trace (scaled as `pdserve bench --trace` scales it, so the simulated workload
is the one the benchmark sends) or from a synthetic mix of request classes.

A prompt block's identity (`SimRequest.block_keys`, one per full engine block) stands for the
chained hash of every token up to its end, as the engine's prefix cache keys blocks: two
requests share block j exactly when their prompts agree up to its end. Keys hash integers
only, so they are the same in every process (string hashes are salted per process).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from cluster.client.workload import TraceEntry, TraceScale


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_keys: tuple[int, ...] = ()  # one per full block of the prompt


@dataclass(frozen=True)
class RequestClass:
    """`weight` parts of a mix are prompts of `input_len` tokens asking for `output_len`."""

    input_len: int
    output_len: int
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1 or not self.weight > 0:
            raise ValueError(f"bad request class {self}: lengths >= 1 and weight > 0")

    @staticmethod
    def parse(text: str) -> RequestClass:
        """`IN:OUT` or `IN:OUT:WEIGHT`, e.g. `2048:16:3`."""
        parts = text.split(":")
        try:
            if len(parts) in (2, 3):
                weight = float(parts[2]) if len(parts) == 3 else 1.0
                return RequestClass(int(parts[0]), int(parts[1]), weight)
        except ValueError:
            pass
        raise ValueError(f"a request class is IN:OUT[:WEIGHT] (e.g. 2048:16:3), got {text!r}")


def trace_requests(
    entries: Iterable[TraceEntry],
    scale: TraceScale,
    block_size: int,
    max_context: int | None = None,
) -> list[SimRequest]:
    """The trace's requests at `scale`, lengths and cuts as `cluster.client.workload`'s
    `trace_workload` makes them. A prompt's tokens beyond its trace blocks' are unique to it."""
    entries = list(entries)
    start = entries[0].timestamp_ms
    width = scale.block_tokens
    limit = max_context or math.inf
    out = []
    for i, e in enumerate(entries):
        n_out = max(1, round(e.output_length * scale.output))
        n_out = int(min(n_out, limit - 1))
        n_in = max(1, round(e.input_length * scale.length))
        fits = int(min(n_in, limit - n_out))
        chain = []
        h = 0
        for hid in e.hash_ids:
            h = hash((h, hid))
            chain.append(h)
        keys = []
        for j in range(fits // block_size):
            end = (j + 1) * block_size
            k = (end - 1) // width
            keys.append(hash((chain[k], end)) if k < len(chain) else hash((-1, i, end)))
        arrival = (e.timestamp_ms - start) / 1e3 * scale.time
        out.append(SimRequest(arrival, fits, n_out, tuple(keys)))
    return out


def mix_requests(
    classes: list[RequestClass],
    num_requests: int,
    rate: float,
    block_size: int,
    seed: int = 0,
) -> list[SimRequest]:
    """`num_requests` requests drawn from `classes` by weight, Poisson arrivals at `rate`
    requests/s (all at once when infinite); no two prompts share a block."""
    if not classes or num_requests < 1 or not rate > 0:
        raise ValueError("a mix needs classes, num_requests >= 1 and rate > 0")
    rng = random.Random(seed)
    weights = [c.weight for c in classes]
    t = 0.0
    out = []
    for i in range(num_requests):
        c = rng.choices(classes, weights)[0]
        keys = tuple(hash((-2, seed, i, j)) for j in range(c.input_len // block_size))
        out.append(SimRequest(t, c.input_len, c.output_len, keys))
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return out
