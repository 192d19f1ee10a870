"""`Simulator`: a discrete-event model of a pdserve cluster of one shape (`ClusterShape`) under
a list of `SimRequest`s, in the profile's time. Events (a heap ordered by time, then by when
they were made, so a run is the same for the same seed):

1. a request arrives; after the router's overhead it goes to a prefilling replica
   (`SimRouter`, prefix affinity by default) and joins its queue;
2. a replica idle with work plans a step (`EngineSim.plan_step`); the step ends after the
   profile's step time, and the tokens it sampled are out at its end;
3. disaggregated: the first token ends the prefill call; a decode replica is chosen (Serve's
   default) and, once it has a batch slot and blocks (`reserve_import`), the KV moves for the
   profile's transfer time, after which the prefill replica's lease ends and the sequence
   joins the decode batch. Colocated: it stays in the batch;
4. optional `ScaleEvent`s change a pool's size: a new replica takes calls after
   `startup_s`, a removed one takes no more and finishes what it has.

A replica of k ranks (`prefill_tp`, `decode_tp`) is one `EngineSim` stepping with the
profile's models for size k; its KV moves in the profile's one transfer time (the same bytes at
any size; a TP-k replica's k NICs are not modelled).

Not modelled: network contention between KV transfers, the router's and proxies' CPU limits,
token streaming, retries and failures.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass

from cluster.planner.engine_sim import EngineSim, SimSeq
from cluster.planner.profile import EngineLimits, Profile
from cluster.planner.sim_result import RequestOutcome, SimResult
from cluster.planner.sim_router import SimRouter
from cluster.planner.sim_workload import SimRequest

MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class ScaleEvent:
    """At `at_s`, pool (`prefill` or `decode`; `decode` is the colocated pool) to `replicas`."""

    at_s: float
    pool: str
    replicas: int


@dataclass(frozen=True)
class ClusterShape:
    """Replica counts and settings. Colocated: `decode_replicas` colocated replicas, no prefill
    pool. `prefill_tp` and `decode_tp` are each pool's tensor-parallel size (a replica's ranks:
    it steps with the profile's models for that size, `Profile.at_tp`). Limits default to the
    profile's at that size."""

    mode: str = "disaggregated"
    prefill_replicas: int = 1
    decode_replicas: int = 1
    prefill_limits: EngineLimits | None = None
    decode_limits: EngineLimits | None = None
    prefill_tp: int = 1
    decode_tp: int = 1  # the colocated pool's too
    prefix_affinity: bool = True
    max_imbalance: int = 2
    transport: str | None = None  # of the profile's KV transfer models; None: the first
    scale_events: tuple[ScaleEvent, ...] = ()
    startup_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.decode_replicas < 1 or (self.mode == MODES[0] and self.prefill_replicas < 1):
            raise ValueError("every pool needs at least one replica")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError("a tensor-parallel size is >= 1")

    @property
    def gpus(self) -> int:
        """The ranks (GPUs) the shape takes."""
        if self.mode == "colocated":
            return self.decode_replicas * self.decode_tp
        return self.prefill_replicas * self.prefill_tp + self.decode_replicas * self.decode_tp

    def describe(self, tp: bool = False) -> str:
        """`6P:4D`, `8 colocated`; with `tp` or any size > 1: `6P@TP2:4D@TP1`, `4 colocated@TP2`."""
        tp = tp or self.prefill_tp > 1 or self.decode_tp > 1
        d = f"@TP{self.decode_tp}" if tp else ""
        if self.mode == "colocated":
            return f"{self.decode_replicas} colocated{d}"
        p = f"@TP{self.prefill_tp}" if tp else ""
        return f"{self.prefill_replicas}P{p}:{self.decode_replicas}D{d}"


class Simulator:
    def __init__(self, profile: Profile, shape: ClusterShape, seed: int = 0) -> None:
        self.profile, self.shape = profile, shape
        self.kv = profile.transfer(shape.transport) if shape.mode == "disaggregated" else None
        self.rng = random.Random(seed)
        self._events: list = []
        self._order = itertools.count()
        self.front = SimRouter(self.rng, shape.prefix_affinity, shape.max_imbalance)
        self.back = SimRouter(self.rng)
        self.engines: dict[str, list[EngineSim]] = {}
        self._pending: dict[str, list[tuple[SimSeq, SimSeq, EngineSim]]] = {}
        self._alive_s: dict[str, float] = {}  # replica -> when it started taking calls
        if shape.mode == "colocated":
            self._grow("decode", shape.decode_replicas, 0.0)
        else:
            self._grow("prefill", shape.prefill_replicas, 0.0)
            self._grow("decode", shape.decode_replicas, 0.0)

    def run(self, requests: list[SimRequest]) -> SimResult:
        over = self.profile.overheads
        self.out = [
            RequestOutcome(i, r.arrival_s, r.prompt_tokens, r.output_tokens, over.proxy_s)
            for i, r in enumerate(requests)
        ]
        self.requests = requests
        for i, r in enumerate(requests):
            self._at(r.arrival_s + over.routing_s, self._arrive, i)
        for ev in self.shape.scale_events:
            self._at(ev.at_s, self._scale, ev)
        now = 0.0
        while self._events:
            now, _, fn, arg = heapq.heappop(self._events)
            fn(now, arg)
        busy = {p: sum(e.busy_s for e in es) for p, es in self.engines.items()}
        alive = {p: sum(now - self._alive_s[e.name] for e in es) for p, es in self.engines.items()}
        return SimResult(self.out, busy, alive)

    def _at(self, t: float, fn, arg) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn, arg))

    def _grow(self, pool: str, n: int, now: float) -> None:
        role = pool if self.shape.mode == "disaggregated" else "colocated"
        limits = self.shape.prefill_limits if pool == "prefill" else self.shape.decode_limits
        tp = self.shape.prefill_tp if pool == "prefill" else self.shape.decode_tp
        profile = self.profile.at_tp(tp)
        es = self.engines.setdefault(pool, [])
        for _ in range(n):
            e = EngineSim(f"{pool}-{len(es)}", role, profile, limits or profile.limits)
            es.append(e)
            ready = now + (self.shape.startup_s if now > 0 else 0.0)
            self._alive_s[e.name] = ready
            if ready > now:
                self._at(ready, self._ready, (pool, e))
            else:
                self._ready(now, (pool, e))

    def _router(self, pool: str) -> SimRouter:
        front = "decode" if self.shape.mode == "colocated" else "prefill"
        return self.front if pool == front else self.back

    def _ready(self, now: float, arg: tuple[str, EngineSim]) -> None:
        pool, engine = arg
        self._router(pool).add(engine)

    def _scale(self, now: float, ev: ScaleEvent) -> None:
        router = self._router(ev.pool)
        live = [e for e in self.engines.get(ev.pool, []) if e in router.replicas]
        if ev.replicas > len(live):
            self._grow(ev.pool, ev.replicas - len(live), now)
        for e in live[max(1, ev.replicas) :]:
            router.remove(e)

    def _arrive(self, now: float, i: int) -> None:
        req = self.requests[i]
        engine = self.front.choose(req.block_keys)
        out = self.out[i]
        out.enqueued_s, out.prefill_replica = now, engine.name
        engine.add(SimSeq(i, req))
        self._kick(engine, now)

    def _kick(self, engine: EngineSim, now: float) -> None:
        """Start a step on an idle replica with work, once every event of this instant is in
        (requests arriving together share the step)."""
        if engine.busy_until is None and engine.has_work():
            engine.busy_until = now
            self._at(now, self._start_step, engine)

    def _start_step(self, now: float, engine: EngineSim) -> None:
        d = engine.plan_step()
        if d is None:
            engine.busy_until = None
            return
        engine.busy_until, engine.busy_s, engine.step_start = now + d, engine.busy_s + d, now
        self._at(now + d, self._step_done, engine)

    def _step_done(self, now: float, engine: EngineSim) -> None:
        outcome = engine.finish_step()
        engine.busy_until = None
        for seq in outcome.admitted:
            self.out[seq.index].scheduled_s = engine.step_start
            self.out[seq.index].cached_tokens = seq.cached_tokens
        for seq in outcome.sampled:
            self._token(engine, seq, now)
        if engine.role == "decode":
            self._start_imports(engine, now)
        self._kick(engine, now)

    def _token(self, engine: EngineSim, seq: SimSeq, now: float) -> None:
        out = self.out[seq.index]
        out.token_times.append(now)
        if engine.role != "prefill":
            if out.finished:
                self._router("decode").done(engine)
            return
        self.front.done(engine)
        if out.finished:
            engine.release(seq)
            self._kick(engine, now)
            return
        decode = self.back.choose()
        out.decode_replica = decode.name
        pending = self._pending.setdefault(decode.name, [])
        pending.append((SimSeq(seq.index, seq.request), seq, engine))
        self._start_imports(decode, now)

    def _start_imports(self, decode: EngineSim, now: float) -> None:
        pending = self._pending.get(decode.name)
        while pending and decode.reserve_import(pending[0][0]):
            dseq, pseq, prefill = pending.pop(0)
            self.out[dseq.index].kv_start_s = now
            assert self.kv is not None
            done = now + self.kv.time(dseq.request.prompt_tokens)
            self._at(done, self._kv_done, (dseq, pseq, prefill, decode))

    def _kv_done(self, now: float, arg: tuple[SimSeq, SimSeq, EngineSim, EngineSim]) -> None:
        dseq, pseq, prefill, decode = arg
        self.out[dseq.index].kv_end_s = now
        prefill.release(pseq)
        self._kick(prefill, now)
        decode.finish_import(dseq)
        self._kick(decode, now)
