"""The engine's mutable state for one request."""

from __future__ import annotations

from enum import Enum

from cluster.engine.grammar import GrammarState
from cluster.engine.prefix_hash import extend_block_hashes
from cluster.errors import PdServeError
from cluster.request import FinishReason, Request


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"  # finished prefill; KV pinned for export
    IMPORTING = "importing"  # blocks reserved; a KV transport is writing the prompt's KV
    FINISHED = "finished"


class Sequence:
    """Tokens so far, how many of them have KV in the cache, and the blocks that hold it.

    Invariant: `num_computed_tokens <= len(token_ids)`; the KV of tokens
    `[0, num_computed_tokens)` lives in `block_table`. A step that computes up to the last
    token samples the next one.
    """

    def __init__(
        self,
        request: Request,
        seed: int,
        eos_token_ids: frozenset[int],
        grammar: GrammarState | None = None,  # advanced over the request's output tokens
    ) -> None:
        self.request = request
        self.grammar = grammar
        self.request_id = request.request_id
        self.params = request.params
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.token_ids: list[int] = [*request.prompt_token_ids, *request.output_token_ids]
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_context_tokens = request.num_context_tokens  # KV before the first new token
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.block_table: list[int] = []  # written only by the BlockManager
        self._block_hashes: list[bytes] = []  # of full blocks of token_ids, memoised
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None  # monotonic; ends the queueing phase

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def in_decode(self) -> bool:
        n = len(self.token_ids)  # read per running sequence on every step
        return n - self.num_computed_tokens == 1 and n > self.num_prompt_tokens

    def block_hashes(self, num_blocks: int, block_size: int) -> list[bytes]:
        """Content hashes of the first `num_blocks` full blocks of `token_ids` (tokens are only
        ever appended, so the hashes of earlier blocks never change)."""
        hashes = extend_block_hashes(self._block_hashes, self.token_ids, num_blocks, block_size)
        return hashes[:num_blocks]

    def append_token(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Add a sampled token; return why the sequence stops, if it does."""
        self.token_ids.append(token_id)
        p = self.params
        if self.grammar is not None:
            if not self.grammar.advance(token_id):
                raise PdServeError(f"token {token_id} is outside the request's constraint")
            if self.grammar.done:
                return "stop"
        if not p.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in p.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= p.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        if self.request.prefill_only:
            return "prefilled"
        return None
