"""Run one scheduled batch through the model and sample the sequences that reached their end.

A decode step replays a captured graph where the runner has `graphs` (a GPU, `model.cuda_graphs`,
see `cluster.engine.cuda_graphs`); everything else runs eagerly.

Fault domains: an exception in the forward pass is the whole step's (the engine's caller
decides what a failed engine does); sampling is per request. A row with no token to pick, or
whose sampling settings make the batched pass raise, gets an error of its own in `Sampled`
(the pass is then redone row by row, so only the rows that raise alone fail)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cluster.engine.cuda_graphs import DecodeGraphs
from cluster.engine.kv_cache import KVCache
from cluster.engine.sampler import NO_TOKEN, Sampler, no_token_error
from cluster.engine.scheduler import ScheduledSeq
from cluster.engine.sequence import Sequence
from cluster.engine.step_inputs import StepInputs
from cluster.errors import PdServeError
from cluster.model.attention import AttentionMetadata, build_decode_group, build_prefill_group
from cluster.model.decode_attention import select_decode_attention
from cluster.model.decoder import CausalLM
from cluster.model.triton_attention import (
    build_varlen_batch,
    select_varlen_attention,
    upload,
)
from cluster.request import TokenLogprobs

log = logging.getLogger("ray.serve." + __name__)


@dataclass(frozen=True)
class Sampled:
    """What one step sampled, per sampling sequence in row order: its token (NO_TOKEN where
    it has none), its logprobs where the request asked, and for each row without a token the
    error that fails that request alone."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    errors: dict[int, PdServeError]


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata
    sample_rows: torch.Tensor  # [S] flat index of each sampling sequence's last token
    samplers: list[ScheduledSeq]  # the S sequences that sample, in row order


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.layout.block_size
        self.sliding_window = model.spec.sliding_window
        self.decode_attention = select_decode_attention(device, self.sliding_window)
        # On a GPU, one kernel for the whole batch (None on the CPU).
        self.varlen_attention = select_varlen_attention(
            device, self.sliding_window, self.block_size
        )
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None  # set by the engine once they are captured

    def announce(self, step: StepInputs) -> None:
        """Tell the step to whoever runs it with us: nobody at TP 1 (a TP leader's runner
        sends it to the other ranks, `TPModelRunner`)."""

    def prepare(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        step = StepInputs.of(scheduled)
        self.announce(step)
        return self.prepare_inputs(step, [s for s in scheduled if s.samples])

    def prepare_inputs(self, step: StepInputs, samplers: list[ScheduledSeq]) -> ForwardBatch:
        """The step's tensors; `samplers` are the sampling sequences (none on a TP follower)."""
        ids = step.token_ids
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        bs = self.block_size
        for start, n, table in zip(step.starts, step.lens, step.block_tables, strict=True):
            starts.append(len(positions))
            span = range(start, start + n)
            positions.extend(span)
            slots.extend([table[p // bs] * bs + p % bs for p in span])
        rows = [starts[i] + n - 1 for i, n in enumerate(step.lens) if step.samples[i]]
        if self.varlen_attention is not None:
            varlen = build_varlen_batch(
                starts, step.lens, step.starts, step.block_tables, self.device
            )
            ids_t, positions_t, slots_t, rows_t = _to_device(
                self.device, ids, positions, slots, rows
            )
            meta = AttentionMetadata(slots_t, None, None, None, varlen, self.varlen_attention)
            return ForwardBatch(ids_t, positions_t, meta, rows_t, samplers)
        # One query per sequence (decode, or a one-token prefill chunk) attends through the
        # decode path; in a batch with no prefill group its rows are 0..T-1 in order.
        dec = [i for i, n in enumerate(step.lens) if n == 1]
        pre = [i for i, n in enumerate(step.lens) if n > 1]
        decode = prefill = None
        if dec:
            decode = build_decode_group(
                [starts[i] for i in dec],
                [step.starts[i] for i in dec],
                [step.block_tables[i] for i in dec],
                self.device,
            )
        if pre:
            prefill = build_prefill_group(
                [starts[i] for i in pre],
                [step.lens[i] for i in pre],
                [step.starts[i] for i in pre],
                [step.block_tables[i] for i in pre],
                self.block_size,
                self.sliding_window,
                self.device,
            )
        return ForwardBatch(
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            attention=AttentionMetadata(
                slot_mapping=self._tensor(slots),
                decode=decode,
                prefill=prefill,
                decode_attention=self.decode_attention,
            ),
            sample_rows=self._tensor(rows),
            samplers=samplers,
        )

    def _tensor(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> Sampled:
        """Compute KV for every scheduled token; return, per sampling seq, the sampled token
        and (if its request asked) the token's logprobs, or why it has none."""
        step = StepInputs.of(scheduled)
        self.announce(step)
        if self.graphs is not None and self.graphs.fits(step):
            return self._sample(self.graphs.run(step), scheduled)
        batch = self.prepare_inputs(step, [s for s in scheduled if s.samples])
        logits = self.forward(batch)
        if logits is None:
            return Sampled([], [], {})
        return self._sample(logits, batch.samplers)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Run the batch; the logits of its sampling rows `[S, vocab]`, None where none samples."""
        hidden = self.model(
            batch.input_ids, batch.positions, self.kv_cache.layers(), batch.attention
        )
        if batch.sample_rows.shape[0] == 0:
            return None
        return self.model.logits(hidden[batch.sample_rows])

    def _sample(
        self,
        logits: torch.Tensor,  # [S, vocab]
        samplers: list[ScheduledSeq],
    ) -> Sampled:
        seqs = [s.seq for s in samplers]
        try:
            return self._pick(logits, seqs)
        except Exception:
            log.exception("sampling a batch of %d rows failed; sampling each row alone", len(seqs))
        picked = [self._pick_alone(logits[r : r + 1], seq) for r, seq in enumerate(seqs)]
        errors = {r: p.errors[0] for r, p in enumerate(picked) if p.errors}
        return Sampled([p.tokens[0] for p in picked], [p.logprobs[0] for p in picked], errors)

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        tokens = self.sampler(
            logits,
            [q.params for q in seqs],
            [q.seed for q in seqs],
            [q.num_output_tokens for q in seqs],
            [q.token_ids for q in seqs],
            [q.grammar for q in seqs],
        )
        wanted = [q.params.logprobs for q in seqs]
        errors: dict[int, PdServeError] = {}
        if NO_TOKEN in tokens:  # the failure path: read those rows back to say why
            errors = {
                r: no_token_error(logits[r], q.params, q.token_ids, q.num_output_tokens)
                for r, (q, t) in enumerate(zip(seqs, tokens, strict=True))
                if t == NO_TOKEN
            }
            wanted = [None if r in errors else n for r, n in enumerate(wanted)]
        logprobs = self.sampler.logprobs(logits, tokens, wanted)
        return Sampled(tokens, logprobs, errors)

    def _pick_alone(self, logits: torch.Tensor, seq: Sequence) -> Sampled:
        try:
            return self._pick(logits, [seq])
        except Exception as e:
            log.exception("sampling request %s failed", seq.request_id)
            error = e if isinstance(e, PdServeError) else PdServeError(f"sampling failed: {e!r}")
            return Sampled([NO_TOKEN], [None], {0: error})


def _to_device(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """`lists` as int64 tensors on `device` from one host buffer in one transfer, pinned and
    asynchronous on a GPU (the step's metadata costs no device sync)."""
    flat = upload([x for xs in lists for x in xs], torch.long, device)
    return list(flat.split([len(xs) for xs in lists]))
