"""The two sides of a tensor-parallel replica's lock step.

Rank 0 (the leader) runs the engine: scheduler, block manager, sampler, as at TP 1. Its runner,
`TPModelRunner`, sends each step's batch (`StepInputs`, one message) to the other ranks as it
prepares the step, then runs the forward pass like any runner; the followers (`follow_steps`)
receive it, build the same tensors over their own KV shard and run the same forward pass. The
collectives inside the model (an all-reduce after o_proj and down_proj, the embedding's and the
LM head's) keep the ranks in step; every rank gets the whole vocabulary's logits, and only the
leader samples. A follower has no scheduler and no sequences: it only ever sees step messages.

The batch is sent once per step, never per layer. A step that fails on any rank fails on all of
them (a collective times out or its peer's socket closes): the engine's caller sees the
exception escape `step`, as for any forward-pass failure, and stops trusting the replica.
"""

from __future__ import annotations

import logging

from cluster.engine.model_runner import ForwardBatch, ModelRunner, StepInputs
from cluster.engine.scheduler import ScheduledSeq
from cluster.model.parallel.group import TPGroup

log = logging.getLogger("ray.serve." + __name__)


class TPModelRunner(ModelRunner):
    """The leader's runner: `prepare` also sends the step to the followers. Decode steps run
    eagerly (no captured graphs at TP > 1 yet)."""

    @property
    def tp(self) -> TPGroup:
        return self.model.tp

    def prepare(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        step = StepInputs.of(scheduled)
        self.tp.broadcast_object(step.to_wire())
        return self.prepare_inputs(step, [s for s in scheduled if s.samples])

    def stop_followers(self) -> None:
        """Tell the followers there will be no more steps (they return from `follow_steps`)."""
        self.tp.broadcast_object(None)


def follow_steps(runner: ModelRunner, tp: TPGroup) -> int:
    """A follower's loop: run every step the leader sends until it sends None; returns the
    number of steps run. Waits for the next step without a deadline (an idle replica sends
    none); any failure propagates, and the leader's next collective fails with it."""
    steps = 0
    while True:
        msg = tp.broadcast_object(timeout_s=None)
        if msg is None:
            return steps
        runner.forward(runner.prepare_inputs(StepInputs.from_wire(msg), []))
        steps += 1
