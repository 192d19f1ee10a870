"""`MeteredEngine`: the engine of a replica, counting as it steps what its stats line reports
beyond `EngineStats`: the prompt tokens it prefilled and how many of them its prefix cache had."""

from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.engine.engine import Engine
from cluster.request import StepOutput


@dataclass(frozen=True)
class EngineTotals:
    """An engine's running totals as of `at` (time.monotonic())."""

    at: float
    prompt_tokens: int = 0  # prompt tokens of the sequences it prefilled
    cached_prompt_tokens: int = 0  # of those, the tokens whose KV came from its prefix cache
    generated_tokens: int = 0  # tokens it sampled


class MeteredEngine(Engine):
    """An `Engine` that adds up, on its own thread, each prefilled prompt's tokens and cached
    tokens from its first output (the output that samples a sequence's first token). Imported
    sequences (decode) were prefilled elsewhere and count nothing; a resumed generation's
    re-prefill is not counted either."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0

    def step(self) -> list[StepOutput]:
        outputs = super().step()
        for out in outputs:
            if out.num_output_tokens == 1 and out.token_ids:
                self.prompt_tokens += out.num_prompt_tokens
                self.cached_prompt_tokens += out.num_cached_tokens
        return outputs

    def totals(self) -> EngineTotals:
        return EngineTotals(
            time.monotonic(), self.prompt_tokens, self.cached_prompt_tokens, self.generated_tokens
        )
