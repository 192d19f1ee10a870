"""`Profile`: what one engine replica of a deployment costs, as step-time models fitted from
probes (`step_fit`, `probe`), and the engine limits it was probed with. The simulator reads
nothing else about the hardware, so a profile refitted on other hardware (or written by hand
from published step times) plans for that hardware.

A step's time, in seconds:
- prefill: `base_s + per_token_s * T + per_attended_s * A`, T the prompt tokens computed in the
  step and A the sum over them of the context each attends to (its position in its prompt:
  attention over the prompt is what makes a long prompt cost more than linearly);
- decode: `base_s + per_seq_s * B + per_context_s * C`, B the sequences decoding and C their
  total context tokens (the KV each step reads);
- a mixed step (a colocated replica, or a decode replica recomputing a preempted sequence):
  both sums, with one base (the larger).

The JSON file (`save`, `load`) is versioned: `load` refuses another `version`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1


def _non_negative(owner: object) -> None:
    for name, value in asdict(owner).items():
        if isinstance(value, float | int) and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{type(owner).__name__}.{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class PrefillStepModel:
    base_s: float
    per_token_s: float
    per_attended_s: float

    def __post_init__(self) -> None:
        _non_negative(self)

    def time(self, tokens: float, attended: float) -> float:
        return self.base_s + self.per_token_s * tokens + self.per_attended_s * attended


@dataclass(frozen=True)
class DecodeStepModel:
    base_s: float
    per_seq_s: float
    per_context_s: float

    def __post_init__(self) -> None:
        _non_negative(self)

    def time(self, batch: float, context_tokens: float) -> float:
        return self.base_s + self.per_seq_s * batch + self.per_context_s * context_tokens


@dataclass(frozen=True)
class KVTransferModel:
    """Moving one prompt's KV from a prefill to a decode replica over `transport`:
    `fixed_s + tokens * bytes_per_token / bandwidth_bytes_per_s`."""

    transport: str
    fixed_s: float
    bandwidth_bytes_per_s: float
    bytes_per_token: int

    def __post_init__(self) -> None:
        _non_negative(self)
        if not self.bandwidth_bytes_per_s > 0 or not self.bytes_per_token > 0:
            raise ValueError("KV transfer bandwidth and bytes per token must be > 0")

    def time(self, tokens: int) -> float:
        return self.fixed_s + tokens * self.bytes_per_token / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Overheads:
    """Per request, outside the engines: `routing_s` the router's hops before the first token,
    `proxy_s` Serve's proxy and the network (the client's end to end less the router's)."""

    routing_s: float = 0.0
    proxy_s: float = 0.0

    def __post_init__(self) -> None:
        _non_negative(self)


@dataclass(frozen=True)
class EngineLimits:
    """The engine settings of one replica: the simulator's defaults for every pool."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    num_kv_blocks: int = 1024
    block_size: int = 16

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineLimits.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class Profile:
    prefill: PrefillStepModel
    decode: DecodeStepModel
    kv_transfer: tuple[KVTransferModel, ...]
    overheads: Overheads = Overheads()
    limits: EngineLimits = EngineLimits()
    # Where it came from: date (ISO 8601), machine, model, how it was measured, sample counts.
    source: dict[str, Any] = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(
                f"profile version {self.version}; this pdserve reads {PROFILE_VERSION}"
            )
        if not self.kv_transfer:
            raise ValueError("a profile needs at least one KV transfer model")

    def transfer(self, transport: str | None = None) -> KVTransferModel:
        """The model for `transport`, or the first one."""
        for kv in self.kv_transfer:
            if transport in (None, kv.transport):
                return kv
        known = ", ".join(kv.transport for kv in self.kv_transfer)
        raise ValueError(f"the profile has no KV transfer model for {transport!r} ({known})")

    def step_time(self, prefill_tokens: int, attended: int, batch: int, context: int) -> float:
        """One engine step computing `prefill_tokens` prompt tokens (attending `attended` in
        all) and decoding `batch` sequences holding `context` tokens."""
        if prefill_tokens and batch:
            base = max(self.prefill.base_s, self.decode.base_s)
            return (
                self.prefill.time(prefill_tokens, attended)
                - self.prefill.base_s
                + self.decode.time(batch, context)
                - self.decode.base_s
                + base
            )
        if prefill_tokens:
            return self.prefill.time(prefill_tokens, attended)
        return self.decode.time(batch, context)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "source": self.source,
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
            "kv_transfer": [asdict(kv) for kv in self.kv_transfer],
            "overheads": asdict(self.overheads),
            "limits": asdict(self.limits),
        }

    @staticmethod
    def from_json(raw: Any) -> Profile:
        if not isinstance(raw, dict):
            raise ValueError("a profile is a JSON object")
        if raw.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"profile version {raw.get('version')!r}; this pdserve reads {PROFILE_VERSION}"
            )
        try:
            return Profile(
                prefill=PrefillStepModel(**raw["prefill"]),
                decode=DecodeStepModel(**raw["decode"]),
                kv_transfer=tuple(KVTransferModel(**kv) for kv in raw["kv_transfer"]),
                overheads=Overheads(**raw.get("overheads", {})),
                limits=EngineLimits(**raw.get("limits", {})),
                source=dict(raw.get("source", {})),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a pdserve profile: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> Profile:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: {e}") from None
        try:
            return Profile.from_json(raw)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
