"""Turn last-position logits into tokens: greedy, temperature, top-k, top-p.

Reproducibility: the random draw for a sequence's output position `i` comes from a generator
seeded with `mix(seed, i)`, and tokens are picked with the exponential race
(argmax of p / Exp(1) noise, equivalent to sampling from p). So a seeded request yields the
same tokens whatever else shares the batch and whichever worker runs the step.
"""

from __future__ import annotations

import torch

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
        positions: list[int],  # output position each row samples
    ) -> list[int]:
        tokens = logits.max(dim=-1).indices.tolist()  # argmax; max() is the faster kernel
        for row, p in enumerate(params):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], p, mix_seed(seeds[row], positions[row]))
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
        gen = torch.Generator(device="cpu").manual_seed(seed)
        noise = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=gen)
        return int((probs.cpu() / noise).argmax())
