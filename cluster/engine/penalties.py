"""Logit adjustments a request asks for before a token is picked: `logit_bias`, then the
repetition penalty, then the frequency and presence penalties.

The same arithmetic as transformers' `SequenceBiasLogitsProcessor` (single-token biases) and
`RepetitionPenaltyLogitsProcessor`, and as OpenAI and vLLM define the other two:

    logit[t] += bias[t]
    if t in prompt or output:  logit[t] = logit[t] * r  if logit[t] < 0  else logit[t] / r
    logit[t] -= frequency * count_in_output(t) + presence * (count_in_output(t) > 0)

Each adjustment is a gather and a scatter at the positions of the rows' tokens, all rows that
use it at once: no pass over the whole vocabulary. The sampler calls this only when some row
of the step adjusts its logits at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cluster.model.triton_attention import upload
from cluster.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor,  # [R, vocab] float32, adjusted in place
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],  # each row's tokens so far: prompt, then output
    num_outputs: Sequence[int],  # how many of each history's tokens are output tokens
) -> torch.Tensor:
    biased = [r for r, p in enumerate(params) if p.logit_bias]
    if biased:
        rows = [r for r in biased for _ in params[r].logit_bias]
        ids = [t for r in biased for t, _ in params[r].logit_bias]
        values = [v for r in biased for _, v in params[r].logit_bias]
        logits.index_put_(
            (_long(rows, logits), _long(ids, logits)), _float(values, logits), accumulate=True
        )
    repeated = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0 and histories[r]]
    if repeated:
        at, _ = _positions(repeated, [histories[r] for r in repeated], logits)
        score = logits[at]  # [R', L]; a token that occurs twice is read, and written, twice alike
        factor = _float([params[r].repetition_penalty for r in repeated], logits)[:, None]
        logits[at] = torch.where(score < 0, score * factor, score / factor)
    counted = [
        r
        for r, p in enumerate(params)
        if (p.frequency_penalty or p.presence_penalty) and num_outputs[r] > 0
    ]
    if counted:
        outputs = [histories[r][len(histories[r]) - num_outputs[r] :] for r in counted]
        at, real = _positions(counted, outputs, logits)
        frequency = _float([params[r].frequency_penalty for r in counted], logits)[:, None]
        presence = _float([params[r].presence_penalty for r in counted], logits)[:, None]
        # Once per occurrence (the padding adds nothing), then once per distinct token.
        logits.index_put_(at, -frequency * real, accumulate=True)
        logits[at] = logits[at] - presence
    return logits


def _positions(
    rows: list[int], tokens: list[Sequence[int]], like: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Index tensors ([R', L] row, [R', L] token id) of each row's tokens, and [R', L] 1.0 where
    a position is real. A short row is padded with its own first token: a repeat, so a read-
    modify-write of a repeated token writes the same value at every occurrence."""
    width = max(len(t) for t in tokens)
    ids = _long([[*t, *[t[0]] * (width - len(t))] for t in tokens], like)
    real = _float([[1.0] * len(t) + [0.0] * (width - len(t)) for t in tokens], like)
    return (_long(rows, like)[:, None].expand_as(ids), ids), real


def _long(values: list, like: torch.Tensor) -> torch.Tensor:
    return upload(values, torch.long, like.device)


def _float(values: list, like: torch.Tensor) -> torch.Tensor:
    return upload(values, torch.float32, like.device)
