"""An engine at GPU token rates on a CPU machine, for the capacity benchmark: the model's forward
pass is replaced by a sleep of a fixed step time, which takes no CPU, as a GPU's kernels take
none of the host's. Everything around it stays: the scheduler, the block manager, each step's
host-side batch (`ModelRunner.prepare`), detokenizing, stop checks, the token stream.

Sampled tokens are made up (a function of the sequence's length, within the vocabulary): the
benchmark measures how tokens travel, not which. `PacedDecodeWorker` is the decode pool's
replica with such an engine, deployed in place of `DecodeWorker`
(`cluster.serving.app.compose_app(config, {"Decode": PACED_DECODE})`); its step time comes from
`STEP_ENV` in the environment of the Ray the benchmark starts.
"""

from __future__ import annotations

import os
import time

from cluster.engine.engine import Engine
from cluster.engine.scheduler import ScheduledSeq
from cluster.request import TokenLogprobs
from decode_worker.decode_worker import DecodeWorker

STEP_ENV = "PDSERVE_BENCH_STEP_S"
PACED_DECODE = "benchmarks.paced_engine:PacedDecodeWorker"


class PacedRunner:
    """Stands in for `ModelRunner`: prepares each step's batch as it does, sleeps `step_s`
    instead of running the model, and samples made-up tokens."""

    def __init__(self, runner, step_s: float, vocab_size: int) -> None:
        self.runner = runner
        self.step_s = step_s
        self.vocab_size = vocab_size

    def run(self, scheduled: list[ScheduledSeq]) -> tuple[list[int], list[TokenLogprobs | None]]:
        batch = self.runner.prepare(scheduled)
        time.sleep(self.step_s)
        seqs = [s.seq for s in batch.samplers]
        tokens = [16 + (7 * len(q.token_ids)) % (self.vocab_size - 16) for q in seqs]
        return tokens, [None] * len(tokens)


def pace(engine: Engine, step_s: float) -> Engine:
    """`engine`, its forward pass replaced by a `step_s` sleep (call while it is idle)."""
    engine.runner = PacedRunner(engine.runner, step_s, engine.info.spec.vocab_size)
    return engine


class PacedDecodeWorker(DecodeWorker):
    async def __init__(self, config) -> None:
        await super().__init__(config)
        pace(self.engine.engine, float(os.environ[STEP_ENV]))
