"""`StepInputs`: what the forward pass of one step needs to know of its batch, in plain lists
(the model runner's input, a decode graph's replay's, and the one message a tensor-parallel
leader sends its followers per step)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.scheduler import ScheduledSeq
from cluster.errors import PdServeError


@dataclass(frozen=True)
class StepInputs:
    """What the forward pass of one step needs to know of its batch, in plain lists: all a
    tensor-parallel follower rank is sent (`to_wire`, msgpack), once per step."""

    token_ids: list[int]  # [T] the new tokens, sequences back to back
    starts: list[int]  # per sequence: the position of its first new token
    lens: list[int]  # per sequence: how many new tokens
    block_tables: list[list[int]]
    samples: list[bool]  # per sequence: whether its last new token samples

    @classmethod
    def of(cls, scheduled: list[ScheduledSeq]) -> StepInputs:
        ids: list[int] = []
        for s in scheduled:
            ids.extend(s.seq.token_ids[s.start : s.start + s.num_tokens])
        return cls(
            ids,
            [s.start for s in scheduled],
            [s.num_tokens for s in scheduled],
            [s.seq.block_table for s in scheduled],
            [s.samples for s in scheduled],
        )

    def to_wire(self) -> list:
        return [self.token_ids, self.starts, self.lens, self.block_tables, self.samples]

    @classmethod
    def from_wire(cls, msg: list) -> StepInputs:
        """Checks the shape of the message: one entry per sequence in each per-sequence list,
        as many tokens as the lengths say."""
        ids, starts, lens, tables, samples = msg
        n = len(starts)
        if not (len(lens) == len(tables) == len(samples) == n) or sum(lens) != len(ids):
            raise PdServeError("malformed step message from the TP leader")
        return cls(ids, starts, lens, tables, samples)
