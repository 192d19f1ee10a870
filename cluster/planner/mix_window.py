"""`MixWindow`: the workload the pools served over the last `window_s` seconds, from the
running counters each engine replica reports (`ReplicaCounters`, polled).

A prefill replica samples exactly one token per prompt it prefills, so its generated tokens
count requests and its prompt tokens their lengths; a decode replica's generated tokens are the
outputs after their first token. Counters are per replica and start at 0 when the replica is
made: each poll adds every replica's growth since the poll before (a replica first seen after
the first poll adds all it has; one gone adds nothing more), so replicas coming and going do
not look like load. The first poll only sets the baseline: what came before it is not known
to be recent.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cluster.planner.split_decision import MixObservation

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class ReplicaCounters:
    """One engine replica's running totals as of a poll."""

    pool: str
    replica_id: str
    generated_tokens: int
    prompt_tokens: int


@dataclass(frozen=True)
class _Growth:
    at: float
    requests: int
    prompt_tokens: int
    decode_tokens: int


class MixWindow:
    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._last: dict[tuple[str, str], ReplicaCounters] | None = None
        self._since = 0.0
        self._growth: deque[_Growth] = deque()

    def add(self, at: float, replicas: list[ReplicaCounters]) -> None:
        """One poll at `at` (seconds, any monotonic clock) of every engine replica."""
        now = {(r.pool, r.replica_id): r for r in replicas if r.pool in (PREFILL, DECODE)}
        if self._last is None:
            self._last, self._since = now, at
            return
        requests = prompt = decode = 0
        for key, r in now.items():
            before = self._last.get(key)
            gen = r.generated_tokens - (before.generated_tokens if before else 0)
            tokens = r.prompt_tokens - (before.prompt_tokens if before else 0)
            if r.pool == PREFILL:
                requests += max(0, gen)
                prompt += max(0, tokens)
            else:
                decode += max(0, gen)
        self._last = now
        self._growth.append(_Growth(at, requests, prompt, decode))
        while self._growth and self._growth[0].at <= at - self.window_s:
            self._growth.popleft()

    def observation(self, now: float) -> MixObservation:
        """What the window holds as of `now` (its span: `window_s`, or less since the first
        poll)."""
        kept = [g for g in self._growth if g.at > now - self.window_s]
        requests = sum(g.requests for g in kept)
        span = min(self.window_s, now - self._since) if self._last is not None else 0.0
        return MixObservation(
            requests=requests,
            prompt_tokens=sum(g.prompt_tokens for g in kept),
            # every request's first token came from prefill
            output_tokens=requests + sum(g.decode_tokens for g in kept),
            span_s=max(0.0, span),
        )
