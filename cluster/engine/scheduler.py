"""Continuous batching with chunked prefill and preemption by recompute.

Each step gets a token budget. Running sequences that are decoding take one token each and go
first (so a long prompt never stalls the streams already running); then partially prefilled
sequences continue, then waiting ones are admitted, their prompts cut into chunks that fit the
remaining budget. When the pool cannot hold a running sequence's next block, the newest running
sequence is preempted: its blocks are freed and it goes back to the head of the queue, to be
recomputed from its tokens later.

Prefix caching: a sequence admitted from the queue first takes the cached blocks of its longest
cached prefix (`BlockManager.reuse_cached_prefix`) and computes only the rest; at least its last
token is always computed, since that yields the logits to sample from. Every block that a step
(or an import) fills is registered in the cache.

Blocks come from and go back to the `BlockManager`, and the scheduler is its only caller: the
engine reserves an import's blocks, frees a finished sequence's and reads the pool's figures
through the scheduler (`reserve_import`, `free`, `blocks_for`, `num_blocks`, `kv_counts`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from cluster.config import SchedulerConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    """Compute the KV of `seq.token_ids[start : start + num_tokens]` this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the last token, so the step samples the next one."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already in the pool (imported) straight to the batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues; the caller decides what happens to its blocks."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)

    # -- the KV pool, as the engine sees it ------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return self.blocks.blocks_for(num_tokens)

    def kv_counts(self) -> tuple[int, int]:
        """Blocks in use, and blocks registered in the prefix cache (in use or reclaimable)."""
        return self.blocks.num_used, self.blocks.num_cached

    def reserve_import(self, seq: Sequence) -> bool:
        """Blocks for the whole context of `seq`, whose KV is computed elsewhere; False if the
        pool is short (nothing reserved then)."""
        return self.blocks.reserve(seq, seq.num_context_tokens)

    def free(self, seq: Sequence) -> None:
        """Give back every block of `seq` (finished, aborted, released or a cancelled import);
        take it out of the queues first (`remove`)."""
        self.blocks.free(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        # Decoding sequences first, then partial prefills, each group oldest first.
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for s in self.running:
            (decoding if s.in_decode else prefilling).append(s)
        queue = deque(decoding + prefilling)
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(seq.num_uncomputed_tokens, budget)
            while not self._reserve(seq, n):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
                budget -= n
        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            self._reuse_cached_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, n):
                self._drop_blocks(seq)
                break
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
        return SchedulerOutput(scheduled, preempted)

    def computed(self, scheduled: list[ScheduledSeq]) -> None:
        """After a step: the scheduled tokens' KV is in the pool."""
        for s in scheduled:
            before = s.seq.num_computed_tokens
            s.seq.num_computed_tokens += s.num_tokens
            self.register_blocks(s.seq, before)

    def register_blocks(self, seq: Sequence, computed_before: int) -> None:
        """Offer the blocks that became full since `computed_before` tokens to the cache."""
        size = self.blocks.block_size
        first, end = computed_before // size, seq.num_computed_tokens // size
        if end <= first or not self.blocks.enable_caching:
            return
        hashes = seq.block_hashes(end, size)
        for i in range(first, end):
            self.blocks.register(seq.block_table[i], hashes[i])

    def tokens_to_prefill(self) -> int:
        """Prompt tokens the queued and partly prefilled sequences still have to compute, less
        the prefix of each queued one that the cache holds now (what admission would reuse)."""
        left = sum(s.num_uncomputed_tokens for s in self.running if not s.in_decode)
        for seq in self.waiting:
            left += seq.num_uncomputed_tokens
            if not seq.block_table and self.blocks.enable_caching:
                hashes = self._reusable_hashes(seq)
                left -= self.blocks.cached_prefix(hashes) * self.blocks.block_size
        return left

    def _reusable_hashes(self, seq: Sequence) -> list[bytes]:
        usable = (seq.num_tokens - 1) // self.blocks.block_size  # keep the last token to compute
        return seq.block_hashes(usable, self.blocks.block_size)

    def _reuse_cached_prefix(self, seq: Sequence) -> None:
        if seq.block_table or not self.blocks.enable_caching:
            return
        hit = self.blocks.reuse_cached_prefix(seq, self._reusable_hashes(seq))
        seq.num_computed_tokens = hit * self.blocks.block_size

    def _drop_blocks(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Grow the block table to hold `n` more tokens; False if the pool is short."""
        return self.blocks.reserve(seq, seq.num_computed_tokens + n)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_blocks(seq)
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
