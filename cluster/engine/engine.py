"""The engine: a model runner over a paged KV pool, driven by a continuous-batching scheduler.

`step()` has three beats: schedule, run the model, update state. Roles differ only in what
requests they are given: the prefill pool submits `prefill_only` requests (the engine stops
after the first token and holds the prompt's KV, `held_blocks`, for a KV transport to read), the
decode pool has a transport write the prompt's KV into blocks it reserves (`reserve_import`,
`finish_import`) and decodes, and a colocated engine does both for plain requests.

Fault domains: a request's own failure (no token to sample, an exception in its sampling,
its stop check or its text) ends that request alone, its blocks freed, with an output that
carries the error (`StepOutput.error`); the rest of the batch goes on. An exception that
escapes `step` (the forward pass, the scheduler) is the engine's: its caller stops trusting it.

Not thread-safe: one thread drives an engine (see `AsyncEngine` for use from asyncio).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from cluster.config import EngineConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.cuda_graphs import capture_decode_graphs
from cluster.engine.grammar import GrammarCompiler, GrammarState
from cluster.engine.kv_cache import KVCache, KVLayout, kv_pool_blocks
from cluster.engine.model_runner import ModelRunner
from cluster.engine.output_processor import OutputProcessor
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import Sequence, SequenceStatus
from cluster.engine.tp_runner import TPModelRunner
from cluster.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PdServeError,
    ResourceExhausted,
)
from cluster.model.decoder import CausalLM
from cluster.model.info import ArchSpec
from cluster.model.loader import LoadedModel, load_model
from cluster.request import FinishReason, Request, RequestOutput, StepOutput, TokenLogprobs

log = logging.getLogger("ray.serve." + __name__)


@dataclass(frozen=True)
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_leased: int  # blocks of prefilled prompts held for export (the prefill leases)
    kv_blocks_cached: int  # blocks registered in the prefix cache, in use or reclaimable
    running: int  # sequences in the batch: prefilling or decoding
    waiting: int  # queued for prefill, or reserved for an import whose KV has not landed yet
    held: int  # prefilled sequences whose KV is held for export (status HELD)
    queued_prompt_tokens: int  # prompt tokens still to prefill (cached prefixes not counted)
    generated_tokens: int  # tokens sampled by this engine since it was made


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        config = config.resolved()  # device, dtype, token budget: "auto"/None made concrete
        self.config = config
        self.loaded = loaded or load_model(config.model)
        self.info = self.loaded.info
        spec = self.info.spec
        self.tokenizer = self.info.tokenizer
        self.device = torch.device(config.model.device)
        self.max_model_len = self.info.max_model_len
        # At TP > 1 this is rank 0 of its replica (`cluster.engine.tp_replica`): its pool holds
        # its shard's KV heads, and every rank's pool has the number of blocks chosen here.
        tp = self.loaded.model.tp
        self.layout = kv_layout(self.info.model_id, self.loaded.model, config)
        num_blocks = kv_pool_blocks(
            config.cache, self.layout.block_bytes, self.device, _activation_bytes(spec, config)
        )
        num_blocks = tp.broadcast_object(num_blocks)
        self.kv_cache = KVCache(self.layout, num_blocks, config.model.torch_dtype, self.device)
        blocks = BlockManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, blocks)  # the block manager's only caller
        runner = ModelRunner if tp.world_size == 1 else TPModelRunner
        self.runner = runner(self.loaded.model, self.kv_cache, self.device)
        # At TP > 1 every rank captures together, after the followers start (`TPReplica`).
        graphs = config.model.cuda_graphs and tp.world_size == 1
        if graphs and self.runner.varlen_attention is not None:
            self.runner.graphs = capture_decode_graphs(
                self.loaded.model,
                self.kv_cache,
                self.runner.varlen_attention,
                config.scheduler.max_num_seqs,
                self.max_model_len,
                self.device,
            )
        self.seqs: dict[str, Sequence] = {}
        self.output_processor = OutputProcessor(self.tokenizer)
        # True: `step` returns text and applies stop strings itself. `AsyncEngine` turns it off
        # before its first step and runs `output_processor` on a thread of its own.
        self.detokenize_in_step = True
        self._pending: list[StepOutput] = []
        self.generated_tokens = 0
        self._grammars: GrammarCompiler | None = None  # made on the first constrained request
        self.imports_every_rank = False  # see `reserve_import`

    # -- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Validate and queue a request. Raises InvalidArgument / ResourceExhausted."""
        seq = self._new_sequence(request)
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise ResourceExhausted("engine queue is full")
        self._admit(seq)
        self.scheduler.add(seq)

    def reserve_import(self, request: Request) -> list[int]:
        """Reserve free blocks for the prompt KV of `request`, computed elsewhere, and return
        them in token order; a KV transport writes them (off the engine thread: nothing else
        touches them) before `finish_import`. Until then the sequence is IMPORTING: never
        scheduled, freed by `abort`. Raises InvalidArgument / ResourceExhausted, and
        FailedPrecondition at TP > 1 unless `imports_every_rank`: the caller's transport writes
        every rank's heads (`cluster.kv_transfer.tp_ranks.ShardedKVClient`), not rank 0's only."""
        if self.loaded.model.tp.world_size > 1 and not self.imports_every_rank:
            raise FailedPrecondition(
                "KV import into a tensor-parallel engine needs every rank's KV server"
            )
        seq = self._new_sequence(request)
        if not self.scheduler.reserve_import(seq):
            n = self.scheduler.blocks_for(seq.num_context_tokens)
            raise ResourceExhausted(f"no room to import {n} KV blocks")
        seq.status = SequenceStatus.IMPORTING
        self.seqs[seq.request_id] = seq
        return list(seq.block_table)

    def finish_import(self, request_id: str, first_token: int) -> None:
        """The reserved blocks of `request_id` hold its prompt KV: append the first token
        sampled by the prefill side and decode from there. NotFound if nothing is reserved."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not SequenceStatus.IMPORTING:
            raise NotFound(f"no KV import reserved for request {request_id!r}")
        seq.num_computed_tokens = seq.num_context_tokens
        self.scheduler.register_blocks(seq, 0)
        self._admit(seq, replay=(*seq.request.output_token_ids, first_token))
        self.scheduler.add_running(seq)
        # The prefill side already streamed this token and its text; only a finish is news.
        out = self._append(seq, first_token)
        if out.finished:
            self._pending.append(replace(out, token_ids=()))

    def cancel_import(self, request_id: str) -> bool:
        """Free the blocks `reserve_import` reserved, unless the import was finished."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not SequenceStatus.IMPORTING:
            return False
        self._free(seq)
        return True

    def _new_sequence(self, request: Request) -> Sequence:
        rid, ids = request.request_id, request.prompt_token_ids
        if rid in self.seqs:
            raise InvalidArgument(f"request_id {rid!r} is already in flight", param="request_id")
        self.info.check_request(ids, request.params)
        request.params.check_vocab(self.info.spec.vocab_size)
        _check_resumed(request, self.info.spec.vocab_size, self.max_model_len)
        longest = min(len(ids) + request.params.max_tokens, self.max_model_len)
        if self.scheduler.blocks_for(longest) > self.scheduler.num_blocks:
            raise InvalidArgument(
                f"prompt of {len(ids)} tokens plus max_tokens {request.params.max_tokens} "
                f"does not fit in this worker's KV pool of {self.scheduler.num_blocks} blocks",
                param="max_tokens",
            )
        seed = request.params.seed
        return Sequence(
            request,
            seed if seed is not None else random.getrandbits(63),
            self.info.eos_token_ids,
            self._grammar(request),
        )

    def _grammar(self, request: Request) -> GrammarState | None:
        """A constrained request's grammar state, advanced over the output it resumes from
        (a migration's tokens): the state travels as the tokens do."""
        so = request.params.structured
        if so is None:
            return None
        if self._grammars is None:  # the first constrained request pays the tokenizer's scan
            if self.tokenizer is None:
                raise InvalidArgument("this model has no tokenizer to constrain", "structured")
            vocab = self.info.spec.vocab_size
            self._grammars = GrammarCompiler(self.tokenizer, vocab, sorted(self.info.eos_token_ids))
        return self._grammars.state(so, replay=request.output_token_ids)

    def _admit(self, seq: Sequence, replay: tuple[int, ...] | None = None) -> None:
        """`replay`: output tokens whose text was streamed already (default: a resumed
        generation's)."""
        self.seqs[seq.request_id] = seq
        request = seq.request
        replay = request.output_token_ids if replay is None else replay
        self.output_processor.add(
            request.request_id, request.prompt_token_ids, seq.params.stop, replay
        )

    # -- the loop --------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def step(self) -> list[StepOutput]:
        """Schedule, run the model, update state. Returns what each request gained."""
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        if plan.scheduled:
            sampled = self.runner.run(plan.scheduled)
            self.scheduler.computed(plan.scheduled)
            sampling = [s for s in plan.scheduled if s.samples]
            self.generated_tokens += len(sampling)
            vocab = self.info.spec.vocab_size
            rows = zip(sampling, sampled.tokens, sampled.logprobs, strict=True)
            for row, (s, token, lp) in enumerate(rows):
                try:
                    if not 0 <= token < vocab:  # never fed back to the model
                        raise sampled.errors.get(row) or PdServeError(f"sampled token {token}")
                    outputs.append(self._append(s.seq, token, lp))
                except Exception as e:
                    outputs.append(self._fail(s.seq, e))
        if not self.detokenize_in_step:
            return outputs
        outputs, stopped = self.output_processor.process(outputs)
        for request_id in stopped:  # ended by a stop string (or its text failed): nothing pending
            seq = self.seqs.get(request_id)
            if seq is not None:
                self._finish(seq, "stop")
        self.output_processor.forget(stopped)
        return outputs

    def _append(
        self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None
    ) -> StepOutput:
        reason = seq.append_token(token, self.max_model_len)
        if reason is not None:
            self._finish(seq, reason)
        n_out = seq.num_output_tokens
        queued, cached = 0.0, 0
        if n_out == 1 and seq.first_scheduled_time is not None:
            queued = seq.first_scheduled_time - seq.request.arrival_time
            cached = seq.num_cached_tokens
        lps = () if logprobs is None else (logprobs,)
        rid, n_prompt = seq.request_id, seq.num_prompt_tokens
        # Positional: built per sequence per step, where keywords cost a frozen dataclass more.
        return StepOutput(rid, (token,), "", reason, n_prompt, n_out, queued, cached, lps)

    def _fail(self, seq: Sequence, exc: Exception) -> StepOutput:
        """End one request on a failure of its own and free its blocks; its last output
        carries the error (a PdServeError as it is, anything else as INTERNAL)."""
        rid = seq.request_id
        log.warning("request %s failed alone: %r", rid, exc, exc_info=_is_bug(exc))
        if not isinstance(exc, PdServeError):
            exc = PdServeError(f"request {rid!r} failed in the engine: {exc!r}")
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        if self.seqs.get(rid) is seq:
            self._free(seq)
        n_prompt, n_out = seq.num_prompt_tokens, seq.num_output_tokens
        return StepOutput(rid, (), "", "abort", n_prompt, n_out, error=exc)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        seq.finish_reason = reason
        if reason == "prefilled":
            seq.status = SequenceStatus.HELD
            return
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.scheduler.free(seq)
        seq.status = SequenceStatus.FINISHED
        self.seqs.pop(seq.request_id, None)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False if it is unknown."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        if seq.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING):
            self.scheduler.remove(seq)
            n_prompt, n_out = seq.num_prompt_tokens, seq.num_output_tokens
            self._pending.append(StepOutput(request_id, (), "", "abort", n_prompt, n_out))
        self._free(seq)
        return True

    # -- KV export -------------------------------------------------------------------------

    def held_blocks(self, request_id: str) -> tuple[list[int], int]:
        """Block ids and token count of a held (prefilled) sequence's prompt KV."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not SequenceStatus.HELD:
            raise NotFound(f"no held KV for request {request_id!r}")
        return list(seq.block_table), seq.num_context_tokens

    def release(self, request_id: str) -> bool:
        """Free a held sequence's blocks (fetched, expired or aborted). Idempotent."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not SequenceStatus.HELD:
            return False
        self._free(seq)
        return True

    # -- conveniences ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        held = [s for s in self.seqs.values() if s.status is SequenceStatus.HELD]
        # An importing sequence (a decode stream whose prompt KV is still on its way) counts as
        # waiting, as vLLM counts a request waiting for remote KV: it holds blocks and joins
        # the batch as soon as its KV lands.
        importing = sum(1 for s in self.seqs.values() if s.status is SequenceStatus.IMPORTING)
        used, cached = self.scheduler.kv_counts()
        return EngineStats(
            kv_blocks_total=self.scheduler.num_blocks,
            kv_blocks_used=used,
            kv_blocks_leased=sum(len(s.block_table) for s in held),
            kv_blocks_cached=cached,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + importing,
            held=len(held),
            queued_prompt_tokens=self.scheduler.tokens_to_prefill(),
            generated_tokens=self.generated_tokens,
        )

    def generate(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """Run requests to completion (all queued at once); outputs in request order."""
        results = {}
        for r in requests:
            self.add_request(r)
            results[r.request_id] = RequestOutput(r.request_id)
        while self.has_work():
            for out in self.step():
                results[out.request_id].add(out)
        return list(results.values())


def kv_layout(model_id: str, model: CausalLM, config: EngineConfig) -> KVLayout:
    """The layout of this rank's KV pool: its shard's KV heads (all of them at TP 1)."""
    return KVLayout(
        model_id=model_id,
        dtype=config.model.dtype,
        num_layers=model.spec.num_layers,
        num_kv_heads=model.shard.local_kv_heads,
        head_dim=model.spec.head_dim,
        block_size=config.cache.block_size,
        kv_head_start=model.shard.first_kv_head,
        total_kv_heads=model.spec.num_kv_heads,
        tp_size=model.shard.world_size,
    )


def _is_bug(exc: Exception) -> bool:
    """Whether a request's failure deserves a traceback in the log (not a documented error)."""
    return not isinstance(exc, PdServeError) or type(exc) is PdServeError


def _check_resumed(request: Request, vocab: int, max_model_len: int) -> None:
    """A resumed generation's outputs (decode migration) must be tokens of this model and leave
    room to generate: fewer than `max_tokens`, and within the context with the prompt."""
    resumed = request.output_token_ids
    if not resumed:
        return
    if any(not 0 <= t < vocab for t in resumed):
        raise InvalidArgument(f"output_token_ids out of vocabulary [0, {vocab})")
    if len(resumed) >= request.params.max_tokens or request.num_context_tokens >= max_model_len:
        raise InvalidArgument(
            f"a generation resumed after {len(resumed)} tokens has no room left "
            f"(max_tokens {request.params.max_tokens}, context {max_model_len})"
        )


def _activation_bytes(spec: ArchSpec, config: EngineConfig) -> int:
    """An estimate of one step's peak activations, kept free of the KV pool on a GPU: per
    batched token the residual, q/k/v/o and the MLP's gate/up/down in the model's dtype, twice
    over for temporaries, plus fp32 logits for every sequence sampled."""
    per_token = (
        6 * spec.hidden_size + 3 * spec.intermediate_size
    ) * config.model.torch_dtype.itemsize
    tokens = config.scheduler.max_num_batched_tokens or 0
    return 2 * tokens * per_token + config.scheduler.max_num_seqs * spec.vocab_size * 4
