"""Fitting a `Profile`'s step-time models to measured samples: pure functions, no I/O.

Each model is linear in its coefficients, so each fit is a least-squares problem over feature
rows, solved with every coefficient >= 0 (a cost has no negative part) and each row weighted
by 1 / its time, so that a short probe counts as much as a long one (relative error):

- a prefill sample is one prompt computed alone: its time is the sum over the chunks the token
  budget cuts it into of the prefill step model, so its features are (steps, tokens computed,
  tokens attended) (`prefill_features`);
- a decode sample is the mean step time of a batch: features (1, batch, context tokens);
- a transfer sample is one prompt's KV moved: features (1, tokens).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from cluster.planner.profile import DecodeStepModel, KVTransferModel, PrefillStepModel


@dataclass(frozen=True)
class PrefillSample:
    """A prompt of `prompt_tokens` prefilled alone, `cached_tokens` of it from the prefix cache,
    in `seconds`, on an engine with a token budget of `budget` per step."""

    prompt_tokens: int
    cached_tokens: int
    seconds: float
    budget: int


@dataclass(frozen=True)
class DecodeSample:
    """Decode steps of `batch` sequences holding `context_tokens` in all took `seconds` each."""

    batch: float
    context_tokens: float
    seconds: float


@dataclass(frozen=True)
class TransferSample:
    tokens: int
    seconds: float


def attended_tokens(start: int, end: int) -> int:
    """Sum over prompt positions start..end-1 of the context each attends to (itself too)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def prefill_features(prompt_tokens: int, cached_tokens: int, budget: int) -> tuple[int, int, int]:
    """(steps, tokens computed, tokens attended) of prefilling a prompt alone: at least its
    last token is computed, in chunks of at most `budget` tokens."""
    start = min(cached_tokens, prompt_tokens - 1)
    computed = prompt_tokens - start
    return math.ceil(computed / budget), computed, attended_tokens(start, prompt_tokens)


def nonnegative_least_squares(rows: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Coefficients c >= 0 minimising sum((row . c - y) / y)^2: the best fit over the subsets
    of columns whose own unconstrained fit is non-negative (the exact answer for the few columns
    here). Raises ValueError when there are fewer distinct rows than columns."""
    x = np.array(rows, dtype=float)
    y = np.array(ys, dtype=float)
    if x.ndim != 2 or len(np.unique(x, axis=0)) < x.shape[1]:
        raise ValueError(f"a fit of {x.shape[-1]} coefficients needs as many distinct samples")
    if not (np.isfinite(y).all() and (y > 0).all()):
        raise ValueError("sample times must be finite and > 0")
    w = 1.0 / y
    xw, yw = x * w[:, None], y * w
    scale = np.linalg.norm(xw, axis=0)
    scale[scale == 0] = 1.0
    best, best_err = [0.0] * x.shape[1], float(np.sum(yw**2))
    columns = range(x.shape[1])
    for cols in itertools.chain.from_iterable(
        itertools.combinations(columns, k) for k in range(1, x.shape[1] + 1)
    ):
        basis = xw[:, cols] / scale[list(cols)]
        c, *_ = np.linalg.lstsq(basis, yw, rcond=None)
        c = c / scale[list(cols)]
        err = float(np.sum((xw[:, cols] @ c - yw) ** 2))
        if (c >= 0).all() and err < best_err * (1 - 1e-12):
            full = [0.0] * x.shape[1]
            for i, v in zip(cols, c, strict=True):
                full[i] = float(v)
            best, best_err = full, err
    return best


def fit_prefill(samples: list[PrefillSample]) -> PrefillStepModel:
    rows = [prefill_features(s.prompt_tokens, s.cached_tokens, s.budget) for s in samples]
    base, per_token, per_attended = nonnegative_least_squares(rows, [s.seconds for s in samples])
    return PrefillStepModel(base, per_token, per_attended)


def fit_decode(samples: list[DecodeSample]) -> DecodeStepModel:
    rows = [(1.0, s.batch, s.context_tokens) for s in samples]
    base, per_seq, per_context = nonnegative_least_squares(rows, [s.seconds for s in samples])
    return DecodeStepModel(base, per_seq, per_context)


def fit_transfer(
    samples: list[TransferSample], transport: str, bytes_per_token: int
) -> KVTransferModel:
    """`fixed_s + tokens * bytes_per_token / bandwidth`. Where the samples show no per-token
    cost (too small to see beside the fixed one), a token per picosecond stands for it."""
    rows = [(1.0, float(s.tokens)) for s in samples]
    fixed, per_token = nonnegative_least_squares(rows, [s.seconds for s in samples])
    if per_token <= 0:
        per_token = 1e-12
    return KVTransferModel(transport, fixed, bytes_per_token / per_token, bytes_per_token)
