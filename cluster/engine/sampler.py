"""Turn last-position logits into tokens: logit bias and penalties (cluster/engine/penalties),
then greedy, or temperature, top-k, top-p and min-p (transformers' warper order) and a draw.
Rows that adjust nothing take the plain path: one argmax over the batch.

Every sampled row of a step is filtered and drawn at once, on the logits' device, and the
step's tokens come back to the host in one copy: on a GPU a batch of sampled rows costs a
fixed few dozen kernels and one sync, not a host round trip per row.

A row with no token to pick (its logits, after its own bias, penalties and temperature, are not
finite: NaN, or overflowed to infinity) gets `NO_TOKEN` instead of an id, decided on the device
with the rest of the step, so the caller fails that request alone; every id returned otherwise
lies in the vocabulary.

Reproducibility: the draw for a sequence's output position `i` is inverse-CDF sampling with
one uniform number, made on the host from `mix_seed(seed, i)`: the first token whose running
(float64) sum of the filtered probabilities passes that fraction of their total. Each row's
filters and sum read that row alone, so a seeded request yields the same tokens whatever else
shares the batch and whichever worker runs the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from cluster.engine.grammar import GrammarState, apply_masks
from cluster.engine.penalties import apply_penalties
from cluster.errors import InvalidArgument, PdServeError
from cluster.model.triton_attention import upload
from cluster.request import TokenLogprobs
from cluster.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
NO_TOKEN = -1  # a row whose logits left no token to pick


def mix_seed(seed: int, position: int) -> int:
    """SplitMix64 of (seed, position): a decorrelated 63-bit number per output position, the
    source of that position's draw (`uniform`)."""
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
        grammars: Sequence[GrammarState | None] = (),  # per row; a constrained row's state
    ) -> list[int]:
        """The token each row picks, or NO_TOKEN for a row whose logits are not finite after
        its adjustments (see above). `logits` is left as it is (logprobs read it raw)."""
        tokens = _argmax(logits)
        adjusted: list[int] = []
        sampled: list[int] = []
        for row, p in enumerate(params):  # one pass: this is per step, per row
            if p.adjusts_logits:
                adjusted.append(row)
            if not p.greedy:
                sampled.append(row)
        if adjusted:
            index = _long(adjusted, logits)
            sub = apply_penalties(
                logits.index_select(0, index).float(),
                [params[r] for r in adjusted],
                [histories[r] for r in adjusted],
                [positions[r] for r in adjusted],
            )
            if grammars:  # after the penalties, so no bias can lift a masked token back
                apply_masks(sub, [grammars[r] for r in adjusted])
            tokens = tokens.index_copy(0, index, _argmax(sub))
        if sampled:
            n = len(sampled)
            u = [uniform(mix_seed(seeds[r], positions[r])) for r in sampled]
            host = upload([*sampled, *u], torch.float64, logits.device)
            index = host[:n].long()
            rows = logits.index_select(0, index)  # raw, or adjusted where the row asks
            if adjusted:
                where = {r: i for i, r in enumerate(adjusted)}
                both = [i for i, r in enumerate(sampled) if r in where]
                picked = _long([where[sampled[i]] for i in both], logits)
                rows.index_copy_(0, _long(both, logits), sub.index_select(0, picked))
            probs = filtered_probs(rows, [params[r] for r in sampled])
            tokens = tokens.index_copy(0, index, draw(probs, host[n:]))
        return tokens.tolist()  # the step's one device-to-host copy

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


def no_token_error(
    logits: torch.Tensor,  # [vocab] the row's raw logits
    params: SamplingParams,
    history: Sequence[int],  # the row's tokens so far: prompt, then output
    num_outputs: int,  # how many of them are output tokens
) -> PdServeError:
    """Why a row got NO_TOKEN, for its request's error; reads the row back from the device, so
    only the failure path calls it. Raw logits that are not finite are the model's fault
    (INTERNAL); else the request's own settings overflowed them: the repetition penalty where
    the adjusted logits are not finite, else the temperature (INVALID_ARGUMENT, field named)."""
    row = logits[None].float()
    if not bool(row.isfinite().all()):
        return PdServeError("the model's logits for this request are not finite")
    if params.adjusts_logits:
        row = apply_penalties(row.clone(), [params], [history], [num_outputs])
        if not bool(row.isfinite().all()):
            return InvalidArgument(
                f"repetition_penalty {params.repetition_penalty:g} makes this request's logits "
                "overflow: no token can be picked",
                param="repetition_penalty",
            )
    return InvalidArgument(
        f"temperature {params.temperature:g} makes this request's logits overflow: no token "
        "can be sampled (use a larger temperature, or 0 for greedy)",
        param="temperature",
    )


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[R, vocab]: the distribution each row draws from, not renormalised: temperature, then
    top-k, top-p and min-p, in the order of transformers' warpers (zero: filtered out). All
    rows at once; a row's filter that is off (top-k 0, top-p 1, min-p 0) removes nothing."""
    vocab = logits.shape[-1]
    kth = [p.top_k - 1 if 0 < p.top_k < vocab else -1 for p in params]  # -1: no top-k
    top_p = [p.top_p if p.top_p < 1.0 else math.inf for p in params]
    knobs = [*(p.temperature for p in params), *kth, *top_p, *(p.min_p for p in params)]
    temperature, cut_at, top_p_t, min_p = upload(knobs, torch.float64, logits.device).view(4, -1, 1)
    logits = logits.float() / temperature.float()
    if max(kth) >= 0:  # each row's k-th largest, from the batch's largest k
        cut = logits.topk(max(kth) + 1, dim=-1).values.gather(1, cut_at.clamp(min=0).long())
        logits = logits.masked_fill((logits < cut) & (cut_at >= 0), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    nucleus = [r for r, t in enumerate(top_p) if math.isfinite(t)]
    if nucleus:  # the sort is the costly part: only the rows that use top-p
        every = len(nucleus) == len(params)
        index = None if every else _long(nucleus, logits)
        sub, at = (probs, top_p_t) if every else (probs[index], top_p_t[index])
        ranked_p, order = sub.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = ranked_p.cumsum(-1) - ranked_p >= at.float()
        sub = sub.scatter(1, order, ranked_p.masked_fill(drop, 0.0))
        probs = sub if every else probs.index_copy(0, index, sub)
    if any(p.min_p > 0.0 for p in params):
        # Relative to the most likely token; as that one always survives top-k and top-p,
        # the unnormalised probabilities give the same cut as renormalised ones.
        probs = probs.masked_fill(probs < min_p.float() * probs.amax(-1, keepdim=True), 0.0)
    return probs


def uniform(seed: int) -> float:
    """A number in [0, 1 - 2**-40] from a 63-bit seed (its top 40 bits): so far below 1 that
    `u * total` stays under a float64 total."""
    return (seed >> 23) / 2.0**40


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [R] token ids
    """Row r's token: the first whose running sum of `probs[r]` (float64) passes `u[r]` (a
    float64 in [0, 1), on the same device) of the row's total. A token filtered to zero has an
    empty interval and is never drawn; a row whose total is not a positive number (a NaN
    anywhere, or nothing left) draws NO_TOKEN."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1]
    picked = torch.searchsorted(cdf, (u * total)[:, None], right=True).squeeze(1)
    # `total > 0` is false for NaN; `picked` can only reach the row's end through rounding.
    valid = (total > 0) & total.isfinite() & (picked < probs.shape[-1])
    return picked.where(valid, NO_TOKEN)


def _argmax(logits: torch.Tensor) -> torch.Tensor:  # [R] token ids
    """Each row's most likely token; NO_TOKEN where the row's largest logit is not finite
    (max() propagates NaN, so that covers a NaN anywhere in the row). max() is the faster
    kernel than argmax."""
    best = logits.max(dim=-1)
    return best.indices.where(best.values.isfinite(), NO_TOKEN)


def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return upload(values, torch.long, like.device)
