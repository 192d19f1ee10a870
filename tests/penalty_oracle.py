"""Oracles for the logit adjustments (cluster/engine/penalties.py): transformers' `generate`
with its own logits processors, and, for OpenAI's frequency and presence penalties (which
transformers lacks), a slow reference loop: a full forward pass per token, transformers'
processors for the bias and the repetition penalty, then the two penalties written out."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessorList,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from cluster.sampling_params import SamplingParams
from tests.conftest import NEAR_TIE_MARGIN


@dataclass(frozen=True)
class Greedy:
    tokens: list[int]
    scores: list[torch.Tensor]  # [vocab] adjusted logits at each step (what argmax saw)


def hf_processors(params: SamplingParams) -> LogitsProcessorList:
    """transformers' processors for `params`' bias and repetition penalty, in the order
    `generate` itself applies them."""
    processors = LogitsProcessorList()
    if params.logit_bias:
        bias = [[[token], value] for token, value in params.logit_bias]
        processors.append(SequenceBiasLogitsProcessor(sequence_bias=bias))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    return processors


@torch.inference_mode()
def hf_generate(model: PreTrainedModel, prompt_ids, n: int, params: SamplingParams) -> Greedy:
    """`model.generate(do_sample=False)` with `hf_processors(params)`."""
    assert not (params.frequency_penalty or params.presence_penalty), "no HF processor for these"
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        logits_processor=hf_processors(params),
        output_scores=True,
        return_dict_in_generate=True,
    )
    return Greedy(out.sequences[0, ids.shape[1] :].tolist(), [s[0].float() for s in out.scores])


@torch.inference_mode()
def reference_greedy(model: PreTrainedModel, prompt_ids, n: int, params: SamplingParams) -> Greedy:
    """Greedy decoding under all of `params`' adjustments, one full forward pass per token."""
    processors = hf_processors(params)
    tokens, scores = list(prompt_ids), []
    vocab = model.config.vocab_size
    for _ in range(n):
        ids = torch.tensor([tokens])
        logits = model(ids).logits[:, -1].float()  # [1, vocab]
        logits = processors(ids, logits)[0]
        counts = torch.bincount(
            torch.tensor(tokens[len(prompt_ids) :], dtype=torch.long), minlength=vocab
        )
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        scores.append(logits)
        tokens.append(int(logits.argmax()))
    return Greedy(tokens[len(prompt_ids) :], scores)


def assert_same_greedy(got: list[int], want: Greedy) -> None:
    """Equal token for token; a divergence is tolerated only at a near-tie of the adjusted
    logits (ARCHITECTURE.md section 7), to the runner-up, with the tokens before it equal."""
    assert len(got) == len(want.tokens), (got, want.tokens)
    if got == want.tokens:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want.tokens, strict=True)) if a != b)
    top2 = want.scores[i].topk(2)
    margin = float(top2.values[0] - top2.values[1])
    assert margin < NEAR_TIE_MARGIN and got[i] in top2.indices.tolist(), (
        f"diverged at step {i}: got {got[i]}, want {want.tokens[i]} (top-2 margin {margin:.3g})"
        f"; got {got}, want {want.tokens}"
    )
