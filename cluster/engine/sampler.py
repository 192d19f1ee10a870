"""Turn last-position logits into tokens: logit bias and penalties (cluster/engine/penalties),
then greedy, or temperature, top-k, top-p and min-p (transformers' warper order) and a draw.
Rows that adjust nothing take the plain path: one argmax over the batch.

Reproducibility: the random draw for a sequence's output position `i` comes from a generator
seeded with `mix(seed, i)`, and tokens are picked with the exponential race
(argmax of p / Exp(1) noise, equivalent to sampling from p). So a seeded request yields the
same tokens whatever else shares the batch and whichever worker runs the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cluster.engine.penalties import apply_penalties
from cluster.request import TokenLogprobs
from cluster.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """SplitMix64 of (seed, position): decorrelated generator seeds per output position."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,  # [S, vocab] float32
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],  # output position each row samples (= output tokens so far)
        histories: Sequence[Sequence[int]] = (),  # each row's tokens; read only for penalties
    ) -> list[int]:
        """The token each row picks. `logits` is left as it is (logprobs read it raw)."""
        tokens = logits.max(dim=-1).indices.tolist()  # argmax; max() is the faster kernel
        adjusted: list[int] = []
        sampled: list[int] = []
        for row, p in enumerate(params):  # one pass: this is per step, per row
            if p.adjusts_logits:
                adjusted.append(row)
            if not p.greedy:
                sampled.append(row)
        rows: dict[int, torch.Tensor] = {}  # the adjusted rows, [vocab] each
        if adjusted:
            index = torch.tensor(adjusted, device=logits.device)
            sub = apply_penalties(
                logits.index_select(0, index).float(),
                [params[r] for r in adjusted],
                [histories[r] for r in adjusted],
                [positions[r] for r in adjusted],
            )
            for r, token in zip(adjusted, sub.max(dim=-1).indices.tolist(), strict=True):
                tokens[r] = token
            rows = dict(zip(adjusted, sub, strict=True))
        for r in sampled:
            row_logits = rows[r] if r in rows else logits[r]
            tokens[r] = self._sample_row(row_logits, params[r], mix_seed(seeds[r], positions[r]))
        return tokens

    def logprobs(
        self,
        logits: torch.Tensor,  # [S, vocab] float32
        tokens: list[int],
        wanted: list[int | None],  # per row: how many alternatives, or None for no logprobs
    ) -> list[TokenLogprobs | None]:
        """Log-probabilities under the model's distribution (raw logits, before any sampling
        transform) of each row's sampled token, and its `wanted` most likely tokens."""
        out: list[TokenLogprobs | None] = [None] * len(tokens)
        rows = [r for r, n in enumerate(wanted) if n is not None]
        if not rows:
            return out
        index = torch.tensor(rows, device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        picked = torch.tensor([tokens[r] for r in rows], device=lp.device)
        chosen = lp.gather(1, picked[:, None]).squeeze(1).tolist()
        top_ids: list[list[int]] = [[] for _ in rows]
        top_vals: list[list[float]] = [[] for _ in rows]
        k = max(wanted[r] for r in rows)
        if k > 0:  # one device-to-host copy each, not one per row
            top = lp.topk(k, dim=-1)
            top_ids, top_vals = top.indices.tolist(), top.values.tolist()
        for i, r in enumerate(rows):
            n = wanted[r]
            alts = tuple(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
            out[r] = TokenLogprobs(chosen[i], alts)
        return out

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams, seed: int) -> int:
        probs = filtered_probs(logits, p)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        noise = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=gen)
        return int((probs.cpu() / noise).argmax())


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:  # [vocab]
    """The distribution a sampled row draws from, not renormalised: temperature, then top-k,
    top-p and min-p, in the order of transformers' warpers (zero: filtered out)."""
    logits = logits.float() / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        # Relative to the most likely token; as that one always survives top-k and top-p,
        # the unnormalised probabilities give the same cut as renormalised ones.
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs
