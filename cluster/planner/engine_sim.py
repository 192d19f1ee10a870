"""`EngineSim`: one simulated engine replica, stepping as `cluster.engine.scheduler` schedules:
each step gets `max_num_batched_tokens`; running sequences go first, decoding ones before
partly prefilled ones, oldest first, one token each for a decode and as much of the prompt as
fits for a prefill; then waiting sequences are admitted while the budget lasts and fewer than
`max_num_seqs` run, each first taking its longest cached prefix. When the pool cannot hold a
running sequence's next block the newest running one is preempted (its blocks freed, back to
the head of the queue, recomputed later). A step's time is the profile's (`Profile.step_time`).

Roles differ only at the edges: a `prefill` replica's sequence leaves the batch once it has
sampled its first token and keeps its blocks (the KV lease) until `release`; a `decode`
replica's sequences arrive with their prompt's KV (`reserve_import`, then `finish_import`); a
`colocated` replica does both phases. The simulator drives it: `plan_step` when the replica is
idle and has work, `finish_step` when that step's time has passed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from cluster.planner.block_pool import BlockPool
from cluster.planner.profile import EngineLimits, Profile
from cluster.planner.sim_workload import SimRequest
from cluster.planner.step_fit import attended_tokens

ROLES = ("prefill", "decode", "colocated")


@dataclass(eq=False)
class SimSeq:
    """One request's sequence on one replica."""

    index: int
    request: SimRequest
    tokens: int = 0  # context: prompt and the tokens sampled so far
    computed: int = 0  # of `tokens`, whose KV is in the pool
    generated: int = 0
    anon: int = 0  # blocks of its own
    keys: list[int] = field(default_factory=list)  # keyed blocks it holds
    cached_tokens: int = 0  # prompt tokens the prefix cache gave it at its first admission
    admitted: bool = False

    def __post_init__(self) -> None:
        self.tokens = self.request.prompt_tokens

    @property
    def blocks(self) -> int:
        return self.anon + len(self.keys)


@dataclass(frozen=True)
class StepOutcome:
    """What one step did: the sequences that sampled a token (at the step's end), and those
    first admitted in it (their queueing ended at its start)."""

    sampled: list[SimSeq]
    admitted: list[SimSeq]


class EngineSim:
    def __init__(self, name: str, role: str, profile: Profile, limits: EngineLimits) -> None:
        assert role in ROLES
        self.name, self.role, self.profile, self.limits = name, role, profile, limits
        self.pool = BlockPool(limits.num_kv_blocks, caching=role != "decode")
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.importing = 0
        self.busy_until: float | None = None
        self.busy_s = 0.0
        self.step_start = 0.0  # when the step in progress began
        self._step: list[tuple[SimSeq, int]] = []
        self._admitted: list[SimSeq] = []

    def add(self, seq: SimSeq) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def reserve_import(self, seq: SimSeq) -> bool:
        """Room for an arriving prompt's KV (decode role): a batch slot and its blocks."""
        if len(self.running) + self.importing >= self.limits.max_num_seqs:
            return False
        need = math.ceil(seq.tokens / self.limits.block_size)
        if not self.pool.allocate(need):
            return False
        seq.anon, seq.computed, self.importing = need, seq.tokens, self.importing + 1
        return True

    def finish_import(self, seq: SimSeq) -> None:
        """The KV is in; the first token (sampled by the prefill replica) joins the batch."""
        self.importing -= 1
        seq.generated, seq.tokens, seq.admitted = 1, seq.tokens + 1, True
        if seq.generated >= seq.request.output_tokens:
            self._free(seq)
        else:
            self.running.append(seq)

    def release(self, seq: SimSeq) -> None:
        """The prefill replica's lease on `seq`'s KV ends."""
        self._free(seq)

    def plan_step(self) -> float | None:
        """Schedule one step; its duration, or None when nothing can run."""
        budget = self.limits.max_num_batched_tokens
        step: list[tuple[SimSeq, int]] = []
        preempted = False
        decoding: list[SimSeq] = []
        prefilling: list[SimSeq] = []
        for s in self.running:
            (decoding if s.tokens - s.computed == 1 and s.generated else prefilling).append(s)
        queue = deque(decoding + prefilling)
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(seq.tokens - seq.computed, budget)
            while not self._reserve(seq, seq.computed + n):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                step.append((seq, n))
                budget -= n
        admitted = []
        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.limits.max_num_seqs
        ):
            seq = self.waiting[0]
            self._reuse_cached_prefix(seq)
            n = min(seq.tokens - seq.computed, budget)
            if not self._reserve(seq, seq.computed + n):
                self._free(seq)
                seq.computed = 0
                break
            self.waiting.popleft()
            if not seq.admitted:
                seq.admitted, seq.cached_tokens = True, seq.computed
                admitted.append(seq)
            self.running.append(seq)
            step.append((seq, n))
            budget -= n
        if not step:
            return None
        self._step, self._admitted = step, admitted
        return self._duration(step)

    def _duration(self, step: list[tuple[SimSeq, int]]) -> float:
        prefill = attended = batch = context = 0
        for seq, n in step:
            if n == 1 and seq.generated and seq.tokens - seq.computed == 1:
                batch += 1
                context += seq.tokens
            else:
                prefill += n
                attended += attended_tokens(seq.computed, seq.computed + n)
        return self.profile.step_time(prefill, attended, batch, context)

    def finish_step(self) -> StepOutcome:
        """Apply the planned step: KV computed, full prompt blocks registered, tokens sampled
        where a chunk reached the end; a finished sequence frees its blocks, a prefill
        replica's leaves the batch holding them."""
        sampled = []
        for seq, n in self._step:
            before = seq.computed
            seq.computed += n
            self._register(seq, before)
            if seq.computed < seq.tokens:
                continue
            seq.generated += 1
            sampled.append(seq)
            if self.role == "prefill" or seq.generated >= seq.request.output_tokens:
                self.running.remove(seq)
                if self.role != "prefill":
                    self._free(seq)
            else:
                seq.tokens += 1
        outcome = StepOutcome(sampled, self._admitted)
        self._step, self._admitted = [], []
        return outcome

    def _register(self, seq: SimSeq, before: int) -> None:
        keys = seq.request.block_keys
        size = self.limits.block_size
        first, end = before // size, min(seq.computed // size, len(keys))
        if end > first and seq.anon:
            new = self.pool.register(keys[first:end], seq.anon)
            seq.anon -= len(new)
            seq.keys += new

    def _reuse_cached_prefix(self, seq: SimSeq) -> None:
        if seq.blocks:
            return
        usable = seq.request.block_keys[: (seq.tokens - 1) // self.limits.block_size]
        hit = usable[: self.pool.match(usable)]
        self.pool.take(hit)
        seq.keys = list(hit)
        seq.computed = len(hit) * self.limits.block_size

    def _reserve(self, seq: SimSeq, tokens: int) -> bool:
        need = math.ceil(tokens / self.limits.block_size) - seq.blocks
        if need <= 0:
            return True
        if not self.pool.allocate(need):
            return False
        seq.anon += need
        return True

    def _preempt(self, seq: SimSeq) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.computed = 0
        self.waiting.appendleft(seq)

    def _free(self, seq: SimSeq) -> None:
        self.pool.release(seq.anon, seq.keys)
        seq.anon, seq.keys = 0, []
