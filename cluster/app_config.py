"""The whole application's configuration, built once at the top and sliced per deployment.

Accepts the plain dict a Serve config file's `args:` holds (see `AppConfig.from_dict`), so the
same settings come from Python, from `serve run`/`serve deploy` files and from the CLI.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TransferConfig
from cluster.errors import InvalidArgument

Mode = Literal["disaggregated", "colocated"]


@dataclass(frozen=True)
class PoolConfig:
    """One deployment's replicas and resources, and (for engine pools) its KV pool and
    scheduler. `torch_threads` 0 keeps torch's default."""

    replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: tuple[tuple[str, float], ...] = ()
    torch_threads: int = 0
    max_ongoing_requests: int = 256
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise InvalidArgument("replicas must be >= 1")
        if self.num_cpus < 0 or self.num_gpus < 0 or self.torch_threads < 0:
            raise InvalidArgument("num_cpus, num_gpus and torch_threads must be >= 0")

    def actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts


@dataclass(frozen=True)
class AppConfig:
    model: ModelConfig
    mode: Mode = "disaggregated"
    router: PoolConfig = field(default_factory=lambda: PoolConfig(num_cpus=0.5))
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    default_max_tokens: int = 256
    request_timeout_seconds: float = 300.0
    # Retries of the prefill hop (and of the whole request when a lease expired) on UNAVAILABLE.
    max_retries: int = 2
    name: str = "pdserve"

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise InvalidArgument(f"mode must be disaggregated or colocated, got {self.mode!r}")
        # Cross-pool contract: both pools must lay out KV blocks the same way.
        if self.prefill.cache.block_size != self.decode.cache.block_size:
            raise InvalidArgument("prefill and decode pools must use the same KV block_size")
        if self.default_max_tokens <= 0 or self.request_timeout_seconds <= 0:
            raise InvalidArgument("default_max_tokens and request_timeout_seconds must be > 0")
        if self.max_retries < 0:
            raise InvalidArgument("max_retries must be >= 0")

    def with_secret(self) -> AppConfig:
        """Give the cluster a capability secret if it has none (one per application)."""
        if self.transfer.secret:
            return self
        return replace(self, transfer=replace(self.transfer, secret=secrets.token_hex(32)))

    def engine_config(self, pool: Literal["prefill", "decode", "colocated"]) -> EngineConfig:
        p = self.prefill if pool == "prefill" else self.decode
        return EngineConfig(
            model=self.model,
            cache=p.cache,
            scheduler=p.scheduler,
            role=pool,
            default_max_tokens=self.default_max_tokens,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AppConfig:
        """Build from nested plain dicts (unknown keys are refused, naming the key)."""
        return _build(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return _dump(self)


def _build(cls, d: dict[str, Any]):
    if not isinstance(d, dict):
        raise InvalidArgument(f"{cls.__name__} must be a mapping, got {type(d).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = set(d) - set(known)
    if unknown:
        raise InvalidArgument(f"unknown {cls.__name__} keys: {sorted(unknown)}")
    kwargs = {}
    for name, value in d.items():
        sub = _NESTED.get((cls, name))
        if sub is not None:
            kwargs[name] = _build(sub, value)
        elif name == "resources":
            kwargs[name] = tuple(sorted((str(k), float(v)) for k, v in dict(value).items()))
        else:
            kwargs[name] = value
    return cls(**kwargs)


def _dump(obj) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        out = {}
        for f in fields(obj):
            v = getattr(obj, f.name)
            out[f.name] = dict(v) if f.name == "resources" else _dump(v)
        return out
    return obj


_NESTED = {
    (AppConfig, "model"): ModelConfig,
    (AppConfig, "router"): PoolConfig,
    (AppConfig, "prefill"): PoolConfig,
    (AppConfig, "decode"): PoolConfig,
    (AppConfig, "transfer"): TransferConfig,
    (PoolConfig, "cache"): CacheConfig,
    (PoolConfig, "scheduler"): SchedulerConfig,
}
