"""Workloads for `pdserve bench` and `pdserve phases`: when each request is sent, its prompt
tokens and how many tokens it asks for.

Two sources:
- a trace in the Mooncake format (one JSON object per line: `timestamp` in ms from the first
  request, `input_length`, `output_length`, `hash_ids` = one id per 512-token prompt block,
  equal ids at equal positions meaning a shared prefix). A small model or a CPU cannot take
  the trace's lengths and rate, so `TraceScale` shrinks the lengths and stretches the clock;
  prompts are built so that requests whose `hash_ids` start alike get token-identical
  prefixes, which the prefix cache can reuse;
- a synthetic one: fixed prompt and output lengths, Poisson arrivals at a given rate (or all
  at once), random prompts that share nothing.

Prompts are token ids (no text: the trace has none), drawn from `[FIRST_TOKEN, vocab)`, above
the low ids where pdserve's generated tokenizers keep their special tokens.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # tokens behind one `hash_ids` entry in a Mooncake trace
FIRST_TOKEN = 16
# Traces shipped with pdserve, by name (`--trace mooncake`); see traces/NOTICE.md.
TRACES = {"mooncake": Path(__file__).parent / "traces" / "mooncake_synthetic_trace.jsonl.gz"}


@dataclass(frozen=True)
class TraceEntry:
    """One line of a Mooncake-format trace, as written there."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceScale:
    """How a trace is shrunk to fit the model and machine at hand: token lengths times
    `length`, the clock times `time` (2.0 = half the rate), output lengths times `output`.
    One trace block (512 tokens) becomes `block_tokens` tokens."""

    length: float = 1 / 32
    time: float = 1.0
    output: float = 1.0

    def __post_init__(self) -> None:
        for name in ("length", "time", "output"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"trace scale {name} must be a positive number, got {value}")

    @property
    def block_tokens(self) -> int:
        return max(1, round(TRACE_BLOCK_TOKENS * self.length))


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to send `arrival_s` after the start. `reusable_tokens`: how many leading
    prompt tokens an earlier request of the workload already sent (what an unbounded prefix
    cache could serve); `clipped`: the prompt was cut to fit the model's context."""

    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    reusable_tokens: int = 0
    clipped: bool = False


@dataclass(frozen=True)
class Workload:
    requests: tuple[WorkloadRequest, ...]
    description: str

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def reusable_tokens(self) -> int:
        return sum(r.reusable_tokens for r in self.requests)


def trace_path(name_or_path: str | Path) -> Path:
    """A shipped trace's file (`TRACES`), or the path as given."""
    return TRACES.get(str(name_or_path), Path(name_or_path))


def load_trace(path: str | Path, limit: int | None = None, skip: int = 0) -> list[TraceEntry]:
    """`limit` entries (all when None) of a Mooncake-format JSONL trace (gzipped when its name
    ends in .gz; a name of `TRACES` for a shipped one), after its first `skip`. Every field is
    checked: a bad line raises ValueError naming the line."""
    entries: list[TraceEntry] = []
    path = trace_path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = (line for line in enumerate(f, 1) if line[1].strip())
        for k, (lineno, line) in enumerate(lines):
            if limit is not None and len(entries) >= limit:
                break
            if k >= skip:
                entries.append(_entry(line, f"{path}:{lineno}"))
    if not entries:
        raise ValueError(f"{path}: no requests in the trace")
    return entries


def _entry(line: str, where: str) -> TraceEntry:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in raw:
            raise ValueError(f"{where}: missing field {name!r}")
    ts, n_in, n_out, ids = (
        raw[k] for k in ("timestamp", "input_length", "output_length", "hash_ids")
    )
    if not _number(ts) or ts < 0:
        raise ValueError(f"{where}: timestamp must be a number >= 0, got {ts!r}")
    for name, value in (("input_length", n_in), ("output_length", n_out)):
        if not _integer(value) or value < 1:
            raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    if not isinstance(ids, list) or not all(_integer(h) for h in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    if len(ids) != -(-n_in // TRACE_BLOCK_TOKENS):
        raise ValueError(
            f"{where}: {len(ids)} hash_ids for {n_in} input tokens "
            f"(expected one per {TRACE_BLOCK_TOKENS})"
        )
    return TraceEntry(float(ts), n_in, n_out, tuple(ids))


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def trace_workload(
    entries: Iterable[TraceEntry],
    scale: TraceScale,
    vocab_size: int,
    max_context: int,
    seed: int = 0,
) -> Workload:
    """The trace's requests at `scale`. Each hash id stands for `scale.block_tokens` tokens,
    the same ones wherever it appears (drawn from `seed` and the id); a prompt is its blocks'
    tokens cut to its scaled length. A prompt that would not leave room for its output in
    `max_context` is cut at the end (counted as clipped)."""
    entries = list(entries)
    start = entries[0].timestamp_ms
    width = scale.block_tokens
    blocks: dict[int, tuple[int, ...]] = {}
    seen: set[int] = set()
    out = []
    for e in entries:
        n_out = min(max(1, round(e.output_length * scale.output)), max_context - 1)
        n_in = max(1, round(e.input_length * scale.length))
        fits = min(n_in, max_context - n_out)
        tokens: list[int] = []
        reusable = 0
        leading = True
        for h in e.hash_ids:
            if len(tokens) >= fits:
                break
            if h not in blocks:
                blocks[h] = _random_tokens(random.Random(f"{seed}:{h}"), width, vocab_size)
            leading = leading and h in seen
            if leading:
                reusable += width
            tokens.extend(blocks[h])
        tokens = tokens[:fits]
        tokens += _random_tokens(
            random.Random(f"{seed}:pad:{len(out)}"), fits - len(tokens), vocab_size
        )
        seen.update(e.hash_ids)
        out.append(
            WorkloadRequest(
                arrival_s=(e.timestamp_ms - start) / 1e3 * scale.time,
                prompt_token_ids=tuple(tokens),
                max_tokens=n_out,
                reusable_tokens=min(reusable, fits),
                clipped=fits < n_in,
            )
        )
    return Workload(
        tuple(out),
        f"trace of {len(out)} requests, lengths x {scale.length:g} "
        f"({scale.block_tokens} tokens per trace block), output lengths x {scale.output:g}, "
        f"clock x {scale.time:g}",
    )


def synthetic_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    rate: float = math.inf,
    seed: int = 0,
) -> Workload:
    """`num_requests` prompts of `input_len` random tokens, each asking for `output_len`
    tokens, arriving as a Poisson process of `rate` requests per second (all at once when
    infinite)."""
    if num_requests < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_requests, input_len and output_len must be >= 1")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(num_requests):
        out.append(WorkloadRequest(t, _random_tokens(rng, input_len, vocab_size), output_len))
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    pace = "all at once" if math.isinf(rate) else f"Poisson arrivals at {rate:g} requests/s"
    return Workload(
        tuple(out),
        f"{num_requests} random prompts of {input_len} tokens, {output_len} output tokens "
        f"each, {pace}",
    )


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    if vocab_size <= FIRST_TOKEN:
        raise ValueError(f"vocab of {vocab_size} tokens is too small for random prompts")
    return tuple(rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(n))
