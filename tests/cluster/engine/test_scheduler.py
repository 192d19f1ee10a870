"""The scheduler's plan per step: token budget, decode-first order, chunking, preemption."""

from __future__ import annotations

from cluster.config import SchedulerConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.scheduler import Scheduler, SchedulerOutput
from cluster.engine.sequence import Sequence, SequenceStatus
from cluster.request import Request
from tests.conftest import greedy


def _seq(rid: str, prompt_len: int, max_tokens: int = 100) -> Sequence:
    return Sequence(Request(rid, tuple(range(prompt_len)), greedy(max_tokens)), 0, frozenset())


def _scheduler(budget: int = 512, num_blocks: int = 64, block_size: int = 4, **kw) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, **kw)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def _advance(plan: SchedulerOutput) -> None:
    """What the engine does after running the plan: KV computed, a token sampled."""
    for s in plan.scheduled:
        s.seq.num_computed_tokens += s.num_tokens
        if s.samples:
            s.seq.token_ids.append(7)


def _plan(plan: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.seq.request_id, s.start, s.num_tokens) for s in plan.scheduled]


def test_long_prompt_is_chunked_within_the_budget():
    sched = _scheduler(budget=8)
    seq = _seq("a", 20)
    sched.add(seq)
    plans = []
    for _ in range(5):
        plan = sched.schedule()
        plans.append(_plan(plan))
        assert plan.num_tokens <= 8
        _advance(plan)
    assert plans == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 4)], [("a", 20, 1)], [("a", 21, 1)]]
    assert seq.num_output_tokens == 3
    assert len(seq.block_table) == sched.blocks.blocks_for(seq.num_computed_tokens)


def test_only_the_last_chunk_samples():
    sched = _scheduler(budget=8)
    sched.add(_seq("a", 12))
    first = sched.schedule()
    assert not first.scheduled[0].samples
    _advance(first)
    assert sched.schedule().scheduled[0].samples


def test_decodes_go_before_prefill_chunks():
    sched = _scheduler(budget=8)
    a, b = _seq("a", 3), _seq("b", 4)
    sched.add(a)
    sched.add(b)
    _advance(sched.schedule())  # both prefilled in one step (7 tokens)
    c = _seq("c", 30)
    sched.add(c)
    plan = sched.schedule()
    assert _plan(plan) == [("a", 3, 1), ("b", 4, 1), ("c", 0, 6)]
    _advance(plan)
    # `c` is now a partial prefill: still after the decodes, taking what the budget leaves.
    d = _seq("d", 5)
    sched.add(d)
    plan = sched.schedule()
    assert _plan(plan) == [("a", 4, 1), ("b", 5, 1), ("c", 6, 6)]
    assert d in sched.waiting


def test_budget_is_never_exceeded_with_many_sequences():
    sched = _scheduler(budget=10, num_blocks=256)
    for i in range(12):
        sched.add(_seq(f"s{i}", 3 + 2 * i))
    for _ in range(40):
        plan = sched.schedule()
        assert 0 < plan.num_tokens <= 10
        _advance(plan)


def test_max_num_seqs_caps_the_running_batch():
    sched = _scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add(_seq(f"s{i}", 3))
    plan = sched.schedule()
    assert [rid for rid, _, _ in _plan(plan)] == ["s0", "s1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_preemption_picks_the_newest_and_requeues_it_first():
    # 6 blocks of 4: three 8-token prompts fill the pool exactly; each first decode needs a
    # third block.
    sched = _scheduler(num_blocks=6, block_size=4)
    a, b, c = _seq("a", 8), _seq("b", 8), _seq("c", 8)
    for s in (a, b, c):
        sched.add(s)
    _advance(sched.schedule())
    assert sched.blocks.num_free == 0
    late = _seq("late", 2)
    sched.add(late)
    plan = sched.schedule()
    assert plan.preempted == [c]
    assert _plan(plan) == [("a", 8, 1), ("b", 8, 1)]  # nothing admitted in a preempting step
    assert (c.status, c.block_table, c.num_computed_tokens) == (SequenceStatus.WAITING, [], 0)
    assert c.num_preemptions == 1
    assert c.num_output_tokens == 1  # its tokens are kept, to be recomputed
    assert list(sched.waiting) == [c, late]
    assert sched.blocks.num_free == 0


def test_preempted_sequence_is_recomputed_from_scratch():
    sched = _scheduler(num_blocks=6, block_size=4)
    a, b, c = _seq("a", 8, max_tokens=2), _seq("b", 8, max_tokens=2), _seq("c", 8)
    for s in (a, b, c):
        sched.add(s)
    _advance(sched.schedule())
    _advance(sched.schedule())  # c preempted; a and b decode their second token
    for s in (a, b):  # they finish; the engine frees their blocks
        sched.remove(s)
        sched.blocks.free(s)
    plan = sched.schedule()
    assert _plan(plan) == [("c", 0, 9)]  # prompt plus its first output, in one pass
    assert plan.scheduled[0].samples


def test_lone_sequence_that_outgrows_the_pool_preempts_itself():
    sched = _scheduler(num_blocks=2, block_size=4)
    seq = _seq("a", 8)
    sched.add(seq)
    _advance(sched.schedule())
    plan = sched.schedule()
    assert plan.preempted == [seq] and not plan.scheduled
    assert sched.blocks.num_free == 2
