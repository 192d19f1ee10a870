"""`recorder`: one Ray histogram with fixed tags, as a plain function of the value, for series
recorded per streamed token (the router's inter-token latency): `Histogram.observe` merges and
checks the tags at every call through Serve's wrapper; merged and checked once, a value
costs Ray's recording call alone.

`Batched` goes further for the router's hot path: values are kept in a list and recorded
together, on the event loop, up to `FLUSH_S` later: one recording call per token per series
cost the router far more under many streams than the calls cost back to back, and batched
they cost it less CPU per token (the serving benchmark's router figure; docs/findings.md).
Every value is still recorded, exactly, each as its own observation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

FLUSH_S = 0.5  # the most a batched value waits; Ray exports every few seconds anyway


def recorder(histogram, tags: dict[str, str]) -> Callable[[float], None]:
    """`histogram.observe(value, tags)` with the tags merged and checked once: straight to
    Ray's recording call (`ray.util.metrics.Metric._metric.record`, what `observe` ends in)
    when this Ray has it, else the public call."""
    metric = getattr(histogram, "_metric", None)
    if metric is None or getattr(histogram, "_discard_metric", False):
        public = getattr(histogram, "observe", None) or histogram.inc  # a counter's
        return lambda value: public(value, tags=dict(tags) or None)
    final = histogram._get_final_tags(dict(tags) or None)
    histogram._validate_tags(final)
    record = metric.record
    return lambda value: record(value, tags=final)


def positive(record: Callable[[float], None]) -> Callable[[float], None]:
    """A counter's recording function that drops additions of 0 or less, as `Counter.inc`
    refuses them."""

    def add(value: float) -> None:
        if value > 0:
            record(value)

    return add


def fan_out(recorders: list[Callable[[float], None]]) -> Callable[[float], None]:
    """One function that records a value with each of `recorders`."""
    if len(recorders) == 1:
        return recorders[0]

    def record(value: float) -> None:
        for r in recorders:
            r(value)

    return record


class Batched:
    """`record`, deferred: each value is kept and recorded, in order, by one `flush` up to
    `flush_s` after the first value since the last flush, on the event loop that recorded it
    (called outside a running loop, a value is recorded at once). Not thread-safe: one loop
    records into it."""

    def __init__(self, record: Callable[[float], None], flush_s: float = FLUSH_S) -> None:
        self.record = record
        self.flush_s = flush_s
        self.values: list[float] = []
        self._timer: asyncio.TimerHandle | None = None

    def __call__(self, value: float) -> None:
        self.values.append(value)
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._timer = loop.call_later(self.flush_s, self.flush)

    def flush(self) -> None:
        """Record every value kept so far."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        values, self.values = self.values, []
        record = self.record
        for value in values:
            record(value)
