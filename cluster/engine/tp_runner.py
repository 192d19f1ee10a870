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

from cluster.engine.model_runner import ModelRunner
from cluster.engine.step_inputs import StepInputs
from cluster.model.parallel.group import TPGroup

log = logging.getLogger("ray.serve." + __name__)


class TPModelRunner(ModelRunner):
    """The leader's runner: each step is sent to the followers before it runs (`announce`).
    With decode graphs (every rank captured the same buckets, `tp_replica`), a step that fits
    one replays on every rank: each decides from the same message."""

    @property
    def tp(self) -> TPGroup:
        return self.model.tp

    def announce(self, step: StepInputs) -> None:
        self.tp.broadcast_object(step.to_wire())

    def stop_followers(self) -> None:
        """Tell the followers there will be no more steps (they return from `follow_steps`)."""
        self.tp.broadcast_object(None)


def follow_steps(runner: ModelRunner, tp: TPGroup) -> tuple[int, int]:
    """A follower's loop: run every step the leader sends until it sends None; returns the
    number of steps run and how many of them replayed a decode graph. Waits for the next step
    without a deadline (an idle replica sends none); any failure propagates, and the leader's
    next collective fails with it."""
    steps = replayed = 0
    while True:
        msg = tp.broadcast_object(timeout_s=None)
        if msg is None:
            return steps, replayed
        step = StepInputs.from_wire(msg)
        if runner.graphs is not None and runner.graphs.fits(step):
            runner.graphs.run(step)  # the leader replays the same bucket
            replayed += 1
        else:
            runner.forward(runner.prepare_inputs(step, []))
        steps += 1
