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

Tensor parallelism: the top-level models are one replica's at `tensor_parallel_size` ranks
(1 unless probed at another size); `tensor_parallel` holds the models and engine limits of a
replica at other sizes (`TPModels`), so one file plans replicas of several sizes (`at_tp`).
The KV transfer models and overheads are shared by every size: a prompt's KV is the same bytes
however many ranks computed it.

The JSON file (`save`, `load`) is versioned: version 2 adds `tensor_parallel_size` and
`tensor_parallel`; `load` reads 1 (one size, TP 1) and 2 and refuses any other.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

PROFILE_VERSION = 2
READABLE_VERSIONS = (1, 2)


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
class TPModels:
    """One replica's step models and engine limits at `size` ranks (its KV blocks are the
    replica's: each rank holds its heads' share of every block)."""

    size: int
    prefill: PrefillStepModel
    decode: DecodeStepModel
    limits: EngineLimits

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"a tensor-parallel size is an integer >= 1, got {self.size!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
            "limits": asdict(self.limits),
        }

    @staticmethod
    def from_json(size: int, raw: dict[str, Any]) -> TPModels:
        return TPModels(
            size,
            PrefillStepModel(**raw["prefill"]),
            DecodeStepModel(**raw["decode"]),
            EngineLimits(**raw["limits"]),
        )


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
    tensor_parallel_size: int = 1  # the ranks of the replica the top-level models are for
    tensor_parallel: tuple[TPModels, ...] = ()  # other sizes, by size

    def __post_init__(self) -> None:
        if self.version not in READABLE_VERSIONS:
            raise ValueError(
                f"profile version {self.version}; this pdserve reads {READABLE_VERSIONS}"
            )
        if not self.kv_transfer:
            raise ValueError("a profile needs at least one KV transfer model")
        sizes = [self.tensor_parallel_size, *(m.size for m in self.tensor_parallel)]
        if len(set(sizes)) != len(sizes) or self.tensor_parallel_size < 1:
            raise ValueError(f"the profile's tensor-parallel sizes repeat or are < 1: {sizes}")

    def tp_sizes(self) -> tuple[int, ...]:
        """The tensor-parallel sizes this profile has models for, ascending."""
        return tuple(sorted({self.tensor_parallel_size, *(m.size for m in self.tensor_parallel)}))

    def models(self) -> tuple[TPModels, ...]:
        """Every size's models, the top-level ones included, ascending by size."""
        top = TPModels(self.tensor_parallel_size, self.prefill, self.decode, self.limits)
        return tuple(sorted((top, *self.tensor_parallel), key=lambda m: m.size))

    def at_tp(self, size: int) -> Profile:
        """This profile as one replica of `size` ranks sees it: that size's models and limits at
        the top level, the same KV transfer and overheads. ValueError if it has none."""
        if size == self.tensor_parallel_size:
            return self
        for m in self.models():
            if m.size == size:
                rest = tuple(o for o in self.models() if o.size != size)
                return replace(
                    self, prefill=m.prefill, decode=m.decode, limits=m.limits,
                    tensor_parallel_size=size, tensor_parallel=rest,
                )  # fmt: skip
        raise ValueError(f"the profile has no models for TP {size} (it has {self.tp_sizes()})")

    def with_limits(self, **overrides: int) -> Profile:
        """The same profile with `overrides` (EngineLimits fields) set at every size."""
        return replace(
            self,
            limits=replace(self.limits, **overrides),
            tensor_parallel=tuple(
                replace(m, limits=replace(m.limits, **overrides)) for m in self.tensor_parallel
            ),
        )

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
            "version": PROFILE_VERSION,
            "source": self.source,
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
            "kv_transfer": [asdict(kv) for kv in self.kv_transfer],
            "overheads": asdict(self.overheads),
            "limits": asdict(self.limits),
            "tensor_parallel_size": self.tensor_parallel_size,
            "tensor_parallel": {str(m.size): m.to_json() for m in self.tensor_parallel},
        }

    @staticmethod
    def from_json(raw: Any) -> Profile:
        if not isinstance(raw, dict):
            raise ValueError("a profile is a JSON object")
        if raw.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"profile version {raw.get('version')!r}; this pdserve reads {READABLE_VERSIONS}"
            )
        if raw["version"] == 1 and ("tensor_parallel" in raw or "tensor_parallel_size" in raw):
            raise ValueError("a version 1 profile has one size, TP 1: no tensor_parallel")
        try:
            tp = raw.get("tensor_parallel", {})
            return Profile(
                prefill=PrefillStepModel(**raw["prefill"]),
                decode=DecodeStepModel(**raw["decode"]),
                kv_transfer=tuple(KVTransferModel(**kv) for kv in raw["kv_transfer"]),
                overheads=Overheads(**raw.get("overheads", {})),
                limits=EngineLimits(**raw.get("limits", {})),
                source=dict(raw.get("source", {})),
                tensor_parallel_size=raw.get("tensor_parallel_size", 1),
                tensor_parallel=tuple(
                    sorted(
                        (TPModels.from_json(int(k), v) for k, v in tp.items()), key=lambda m: m.size
                    )
                ),  # fmt: skip
            )
        except (KeyError, TypeError, AttributeError) as e:
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


def merge_profiles(profiles: list[Profile]) -> Profile:
    """One profile holding every size of `profiles` (each probed at its own TP size): the
    smallest size's profile at the top level (its KV transfer, overheads and source), the
    others' models and limits under `tensor_parallel`. ValueError if a size repeats."""
    if not profiles:
        raise ValueError("nothing to merge")
    models = [m for p in profiles for m in p.models()]
    sizes = [m.size for m in models]
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"the profiles' tensor-parallel sizes repeat: {sorted(sizes)}")
    base = min(profiles, key=lambda p: p.tensor_parallel_size)
    others = tuple(sorted((m for m in models if m.size != base.tensor_parallel_size),
                          key=lambda m: m.size))  # fmt: skip
    sources = {str(p.tensor_parallel_size): p.source for p in profiles if p is not base}
    source = {**base.source, "merged_tp_sources": sources} if sources else base.source
    return replace(base, tensor_parallel=others, source=source)
