"""A served stream checked token by token against transformers (benchmarks/soak_bench's oracle).

The prompt and the tokens served go through transformers' model in one pass; the logits at
each output position give the token the engine's rule picks there: greedy the argmax, sampled
the draw `cluster.engine.sampler` makes (its filters, and the uniform number `mix_seed(seed,
position)` fixes). A token equal to it is exact. The engine's logits are transformers' to a
rounding, and another batch rounds otherwise, so where two tokens are a hair apart either is
right: greedy where the served token's logit is within `TOL` of the largest, sampled where the
draw lies within `TOL` (of the row's total) of the served token's interval of the running sum.
Any other token is wrong: lost, repeated, drawn at the wrong position or from other KV. Each
position is checked on the served prefix, so one boundary token does not hide the rest."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cluster.engine.sampler import filtered_probs, mix_seed, uniform
from cluster.sampling_params import SamplingParams

TOL = 1e-3


class StreamOracle:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def check(self, prompt: Sequence[int], served: Sequence[int], params: SamplingParams) -> str:
        """ "exact", "boundary" (some token within `TOL` of the edge) or "wrong"."""
        if not served:
            return "exact"
        ids = torch.tensor([[*prompt, *served]])
        logits = self.model(ids).logits[0, len(prompt) - 1 : -1].double()
        got = torch.tensor(served)
        if params.greedy:
            top = logits.max(-1).values
            mine = logits.gather(1, got[:, None]).squeeze(1)
            exact, near = mine == top, mine >= top - TOL
        else:
            probs = filtered_probs(logits.float(), [params] * len(served)).double()
            cdf = probs.cumsum(-1)
            total = cdf[:, -1]
            u = torch.tensor([uniform(mix_seed(params.seed, i)) for i in range(len(served))])
            at = u.double() * total
            hi = cdf.gather(1, got[:, None]).squeeze(1)
            lo = hi - probs.gather(1, got[:, None]).squeeze(1)
            exact = (lo <= at) & (at < hi)
            near = (lo - TOL * total <= at) & (at <= hi + TOL * total)
        if bool(exact.all()):
            return "exact"
        return "boundary" if bool(near.all()) else "wrong"
