"""The whole application's configuration, built once at the top and sliced per deployment.

Accepts the plain dict a Serve config file's `args:` holds (`AppConfig.from_dict`, strict: see
`cluster.config.parse_config`), so the same settings come from Python, from `serve run`/`serve
deploy` files and from the CLI; `app_config_schema` is that dict's JSON schema.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Literal, overload

from pydantic import with_config

from cluster.config import (
    DICT_FORM,
    ConfigError,
    EngineConfig,
    ModelConfig,
    TransferConfig,
    config_schema,
    dump_config,
    parse_config,
)
from cluster.kv_transfer import registry
from cluster.request import MAX_STREAM_INTERVAL
from cluster.serving.api_keys import ClientAuth
from cluster.serving.autoscaling import (
    DECODE_TARGETS,
    PREFILL_TARGETS,
    ROUTER_TARGETS,
    AppAutoscaling,
)
from cluster.serving.config_docs import describe_fields

# The pools' configs live in pool_config.py; importing them from here keeps working.
from cluster.serving.pool_config import (
    DISAGGREGATED_TP_SIZES,
    ENGINE_FIELDS,
    DeploymentConfig,
    PoolConfig,
    check_tp_split,
)

Mode = Literal["disaggregated", "colocated"]
# The names router/chat registers (a test keeps them equal).
ToolCallParserName = Literal["", "hermes", "qwen3_coder", "llama3_json", "mistral"]
ReasoningParserName = Literal["", "qwen3", "deepseek_r1"]
PoolName = Literal["router", "prefill", "decode", "colocated"]
ENGINE_POOLS = ("prefill", "decode")  # the `AppConfig` fields that hold engine pools
# A router replica's requests at once when `router.max_ongoing_requests` is 0.
ROUTER_ONGOING = 1024
log = logging.getLogger("ray.serve." + __name__)


@with_config(DICT_FORM)
@dataclass(frozen=True)
class RouterConfig(ClientAuth, DeploymentConfig):
    """The router deployment: `DeploymentConfig`'s fields (no engine: `max_ongoing_requests`
    0 = ROUTER_ONGOING), `ClientAuth`'s (API keys, direct TLS) and its direct gRPC endpoint
    (router/direct/): with `direct_grpc` each router replica also serves `pdserve.v1.Generation`
    on `transfer.host`, at `grpc_port` (0 = a free port), listed in `GetStats`. A fixed port
    puts at most one router replica per node (`max_replicas_per_node`): no two bind it."""

    num_cpus: float = 0.5
    num_gpus: float = 0.0  # a number: "auto" is an engine pool's
    max_ongoing_requests: int = ROUTER_ONGOING
    direct_grpc: bool = True
    grpc_port: int = 0

    # `parse_config`'s message for each engine key written under `router:`.
    REFUSED_KEYS = {
        name: "an engine pool's setting; the router runs no engine" for name in ENGINE_FIELDS
    }

    def __post_init__(self) -> None:
        super().__post_init__()  # ClientAuth's, then DeploymentConfig's
        if not 0 <= self.grpc_port <= 65535:
            raise ConfigError(f"grpc_port must be in 0..65535, got {self.grpc_port}")
        if self.grpc_port and not self.direct_grpc:
            raise ConfigError("grpc_port is set but direct_grpc is off")

    @property
    def ongoing_limit(self) -> int:
        return self.max_ongoing_requests or ROUTER_ONGOING

    @classmethod
    def of(cls, pool: DeploymentConfig) -> RouterConfig:
        """`pool` as a router's config (the direct endpoint at its defaults). From Python a
        `PoolConfig` may stand for the router (one pool config shared by all deployments):
        only its deployment fields are read, and `engine_cpus` is refused (a router pinned to
        the engine cores would take them from the engines). The dict form refuses every
        engine key under `router:` by name (`REFUSED_KEYS`). Its request limit stays what it
        was for that pool (`ongoing_limit`)."""
        if isinstance(pool, RouterConfig):
            return pool
        if isinstance(pool, PoolConfig) and pool.engine_cpus:
            raise ConfigError(f"router.engine_cpus: {cls.REFUSED_KEYS['engine_cpus']}")
        kept = {name: getattr(pool, name) for name in DeploymentConfig.__dataclass_fields__}
        gpus = 0.0 if pool.num_gpus == "auto" else pool.num_gpus
        return cls(**{**kept, "num_gpus": gpus, "max_ongoing_requests": pool.ongoing_limit})

    def serve_placement(self) -> dict[str, Any]:
        return {"max_replicas_per_node": 1} if self.grpc_port else {}


def auto_transport(mode: Mode) -> str:
    """The KV transport "auto" stands for (`registry.choose_auto`): the first registered
    candidate that works here ("nixl" where NIXL imports and two agents here move bytes to
    each other through UCX, which across nodes takes TCP wherever gRPC reaches), else the
    baseline, "grpc". A colocated app moves no KV: the baseline, unprobed."""
    if mode == "colocated":
        return registry.BASELINE
    name, why_not = registry.choose_auto()
    if why_not:
        log.warning("KV transport: %s (%s)", name, "; ".join(why_not))
    return name


@with_config(DICT_FORM)
@dataclass(frozen=True)
class AppConfig:
    model: ModelConfig
    mode: Mode = "disaggregated"
    router: RouterConfig = field(default_factory=RouterConfig)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    default_max_tokens: int = 256
    # Chat (vLLM's flags; router/chat). Every field's meaning: cluster/serving/config_docs.py.
    tool_call_parser: ToolCallParserName = ""
    enable_auto_tool_choice: bool = False
    reasoning_parser: ReasoningParserName = ""
    chat_template: str = ""
    default_chat_template_kwargs: str = ""
    # Sampling defaults for requests that leave a setting unset (vLLM's --generation-config):
    # "auto" = the checkpoint's generation_config.json, "vllm" = none (SamplingParams'
    # own), or a directory holding a generation_config.json.
    generation_config: str = "auto"
    # Tokens per streamed message after the first, unless a request says (1: each at once).
    stream_interval: int = 1
    request_timeout_seconds: float = 300.0
    # Retries of the prefill hop (and of the whole request when a lease expired) on UNAVAILABLE.
    max_retries: int = 2
    # Resumes of a generation on another replica after its hop failed mid-stream (migration).
    max_migrations: int = 3
    # Autoscaling across pools (the ratio policy); each pool's own is under the pool.
    autoscaling: AppAutoscaling = field(default_factory=AppAutoscaling)
    name: str = "pdserve"

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ConfigError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        # Cross-pool contract: both pools must lay out KV blocks the same way.
        if self.prefill.cache.block_size != self.decode.cache.block_size:
            raise ConfigError("prefill and decode pools must use the same KV block_size")
        tp = {p: getattr(self, p).tensor_parallel_size for p in ENGINE_POOLS}
        if self.mode == "disaggregated" and not set(tp.values()) <= set(DISAGGREGATED_TP_SIZES):
            raise ConfigError(
                f"tensor_parallel_size is prefill {tp['prefill']}, decode {tp['decode']}: KV "
                f"moves between TP sizes {DISAGGREGATED_TP_SIZES} (in a colocated app, up to 8)"
            )
        if self.default_chat_template_kwargs:
            _json_object(self.default_chat_template_kwargs, "default_chat_template_kwargs")
        if self.default_max_tokens <= 0 or self.request_timeout_seconds <= 0:
            raise ConfigError("default_max_tokens and request_timeout_seconds must be > 0")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ConfigError(
                f"stream_interval must be in 1..{MAX_STREAM_INTERVAL}, got {self.stream_interval}"
            )
        if self.max_retries < 0 or self.max_migrations < 0:
            raise ConfigError("max_retries and max_migrations must be >= 0")
        # A plain PoolConfig (built in Python) becomes the router's, checked as one.
        object.__setattr__(self, "router", RouterConfig.of(self.router))
        device = self.model.device
        transport = self.transfer.transport
        if transport != "auto" and transport not in registry.names():
            raise ConfigError(f"transfer.transport: expected 'auto' or one of {registry.names()}")
        if (
            transport != "auto"
            and registry.get(transport).needs_cuda
            and not device.startswith(("cuda", "auto"))
        ):
            raise ConfigError(f"transport {transport} moves KV between GPUs: it needs device cuda")
        if self.autoscaling.ratio_policy is not None:
            ratio = self.autoscaling.ratio_policy
            ratio.check_pools(self.mode, self.prefill.autoscaling, self.decode.autoscaling)
        if self.router.autoscaling is not None:
            engine_only = sorted({s for s, _ in self.router.autoscaling.targets} - {"requests"})
            if engine_only:
                raise ConfigError(
                    f"router.autoscaling.targets: {engine_only} are engine signals; the router "
                    'scales on "requests" only'
                )

    def resolved(self) -> AppConfig:
        """Fill what is derived at build time: a hub id's revision (pinned to its commit,
        `cluster.model.hub.pinned`), the token budget of an explicit device, the KV transport
        if "auto" (`auto_transport`), the capability secret (one per app), default autoscaling
        signals, API keys (`with_keys_loaded`): no replica decides these again. Device and dtype
        "auto" (and the budget) each engine replica decides where it runs (`replica_device`)."""
        from cluster.model.hub import pinned

        model = pinned(self.model)
        if self.mode == "disaggregated":
            check_tp_split(
                model, self.prefill.tensor_parallel_size, self.decode.tensor_parallel_size
            )
        budget = {p: getattr(self, p).scheduler.for_device(model.device) for p in ENGINE_POOLS}
        config = replace(
            self,
            model=model,
            **{p: replace(getattr(self, p), scheduler=budget[p]) for p in ENGINE_POOLS},
        )
        if config.transfer.transport == "auto":
            transport = auto_transport(self.mode)
            config = replace(config, transfer=replace(config.transfer, transport=transport))
        if not config.transfer.secret:
            secret = secrets.token_hex(32)
            config = replace(config, transfer=replace(config.transfer, secret=secret))
        if config.autoscaling.ratio_policy is not None:
            ratio = config.autoscaling.ratio_policy.resolved()
            config = replace(config, autoscaling=AppAutoscaling(ratio_policy=ratio))
        return replace(
            config,
            router=config.router.with_default_targets(ROUTER_TARGETS).with_keys_loaded(),
            prefill=config.prefill.with_default_targets(PREFILL_TARGETS),
            decode=config.decode.with_default_targets(DECODE_TARGETS),
        )

    @overload
    def pool(self, name: Literal["router"]) -> RouterConfig: ...
    @overload
    def pool(self, name: Literal["prefill", "decode", "colocated"]) -> PoolConfig: ...
    def pool(self, name: str) -> DeploymentConfig:
        """The config of pool `name`: "router", "prefill", "decode", or "colocated" (the
        colocated app's engines are the `decode` pool)."""
        if name == "router":
            return self.router
        if name == "prefill":
            return self.prefill
        if name in ("decode", "colocated"):
            return self.decode
        raise ValueError(f"no pool {name!r}; the pools: {PoolName.__args__}")

    def engine_config(self, pool: Literal["prefill", "decode", "colocated"]) -> EngineConfig:
        """The engine slice of `pool`. A prefill engine is given `model.cuda_graphs` off: its
        requests are `prefill_only` (each stops at the token its prefill samples), so it never
        runs the decode steps the graphs are captured for, and capturing them would only cost
        start-up time and GPU memory. The decode and colocated engines keep the setting."""
        p = self.pool(pool)
        return EngineConfig(
            model=replace(self.model, cuda_graphs=False) if pool == "prefill" else self.model,
            cache=p.cache,
            scheduler=p.scheduler,
            default_max_tokens=self.default_max_tokens,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AppConfig:
        """Build from the dict form (nested plain dicts, as in a Serve config's `args`),
        validated strictly: unknown keys, wrong types and unknown autoscaling signals are
        refused with INVALID_ARGUMENT naming each field's path."""
        return parse_config(cls, d)

    def to_dict(self) -> dict[str, Any]:
        """The dict form (plain JSON types); `from_dict` reads it back."""
        return dump_config(self)


def app_config_schema() -> dict[str, Any]:
    """The JSON schema of a Serve config's `args` for `cluster.serving.app:build_app` (the
    dict form of `AppConfig`). There `model` and `model.path` may be left out: the builder
    then serves the embedded tiny model."""
    schema = config_schema(AppConfig)
    describe_fields(schema, "AppConfig")
    schema.pop("required")  # ["model"]
    schema["$defs"]["ModelConfig"].pop("required")  # ["path"]
    schema["title"] = "pdserve AppConfig"
    schema["description"] = (
        "The `args` of a Serve config for cluster.serving.app:build_app (AppConfig.from_dict); "
        "fields: docs/configuration.md"
    )
    return schema


def _json_object(text: str, name: str) -> None:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object, got {type(value).__name__}")
