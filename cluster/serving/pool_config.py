"""An engine pool's deployment config (`PoolConfig`) and what every deployment shares
(`DeploymentConfig`): size, Ray resources and placement, request limits, and an engine pool's
engine settings, tensor parallelism among them. `AppConfig` (app_config.py) composes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Annotated, Any, Literal, Self

from pydantic import BeforeValidator, with_config

from cluster.config import DICT_FORM, CacheConfig, ConfigError, Resources, SchedulerConfig
from cluster.errors import InvalidArgument
from cluster.serving.autoscaling import AutoscalingSettings
from cluster.serving.cpu_affinity import parse_cpu_list

# Ranks one engine replica may span (`PoolConfig.tensor_parallel_size`): a power of two up to
# one node's usual 8 GPUs. Whether a size splits the model (heads, KV heads, intermediate
# size) the engine checks against the checkpoint (`TPReplica`, `cluster.model.parallel`).
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
# A replica's ranks all on one node: its followers are processes of the replica's own.
TP_STRATEGY = "STRICT_PACK"
# The sizes KV moves between in a disaggregated app (`cluster.kv_transfer.tp_ranks`).
DISAGGREGATED_TP_SIZES = (1, 2, 4)


def check_tp_split(model, prefill_tp: int, decode_tp: int) -> None:
    """ConfigError, naming both sizes, unless the checkpoint of `model` (a `ModelConfig`)
    splits over both pools' TP sizes (heads, KV heads, intermediate size), so that every
    decode rank's KV heads are held whole by prefill ranks."""
    from cluster.model.info import describe_model
    from cluster.model.parallel.shard import TPShard

    sizes = {prefill_tp, decode_tp} - {1}
    if not sizes:
        return
    spec = describe_model(model).spec
    for k in sorted(sizes):
        try:
            TPShard.of(spec, 0, k)
        except InvalidArgument as e:
            raise ConfigError(
                f"prefill tensor_parallel_size {prefill_tp} -> decode {decode_tp}: {e.message}"
            ) from None


def _cpu_list(value: Any) -> tuple[int, ...]:
    try:
        return parse_cpu_list(value)
    except InvalidArgument as e:
        raise ConfigError(e.message) from None


# In the dict form a Linux cpu list ("2-7"), one core or a list of cores.
CpuList = Annotated[
    tuple[int, ...], BeforeValidator(_cpu_list, json_schema_input_type=str | int | list[int])
]


@with_config(DICT_FORM)
@dataclass(frozen=True)
class DeploymentConfig:
    """What every deployment has, the router's and the engine pools': its size or autoscaling,
    its Ray resources per replica and its request limits."""

    replicas: int = 1  # fixed size; ignored when `autoscaling` is set
    num_cpus: float = 1.0
    # "auto" (engine pools' default): by the device and the cluster's nodes (gpu_placement.py)
    num_gpus: float | Literal["auto"] = 0.0
    resources: Resources = ()
    # Requests one replica works on at once; 0 = the pool's own default (`ongoing_limit`).
    max_ongoing_requests: int = 0
    # Requests waiting for a replica beyond that; more are refused at once. 0 = 4x ongoing.
    max_queued_requests: int = 0
    autoscaling: AutoscalingSettings | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError("replicas must be >= 1")
        if min(self.num_cpus, 0 if self.num_gpus == "auto" else self.num_gpus) < 0:
            raise ConfigError("num_cpus and num_gpus must be >= 0")
        if self.max_ongoing_requests < 0 or self.max_queued_requests < 0:
            raise ConfigError("max_ongoing_requests and max_queued_requests must be >= 0")

    @property
    def ongoing_limit(self) -> int:
        raise NotImplementedError

    @property
    def queued_limit(self) -> int:
        return self.max_queued_requests or 4 * self.ongoing_limit

    def with_default_targets(self, targets: tuple[tuple[str, float], ...]) -> Self:
        """Fill the pool's autoscaling targets with `targets` if none were configured."""
        if self.autoscaling is None or self.autoscaling.targets:
            return self
        return replace(self, autoscaling=replace(self.autoscaling, targets=targets))

    def serve_placement(self) -> dict[str, Any]:
        """Placement options of the pool's Serve deployment beyond its resources."""
        return {}

    def actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts


@with_config(DICT_FORM)
@dataclass(frozen=True)
class PoolConfig(DeploymentConfig):
    """An engine pool's deployment (prefill, decode, colocated): `DeploymentConfig`'s fields,
    its engine threads, prefix-affinity routing, KV pool and scheduler. `torch_threads` 0 keeps
    torch's default; `max_ongoing_requests` 0 = the scheduler's `max_num_seqs`.

    `tensor_parallel_size` k > 1: each replica's engine spans k ranks (`TPReplica`: rank 0 in
    the replica's process, ranks 1..k-1 Ray actors it starts in its placement group's bundles).
    `num_cpus` and `num_gpus` are then each rank's: the deployment reserves one placement-group
    bundle per rank, all on one node (`serve_placement`)."""

    num_gpus: float | Literal["auto"] = "auto"
    tensor_parallel_size: int = 1
    torch_threads: int = 0
    # Python's GIL switch interval in this pool's engine replicas. The engine thread shares the
    # GIL with Serve's event loop; at Python's default (5 ms) each burst of the loop's work
    # stalls the step for its whole length; a short interval bounds each stall.
    gil_switch_interval_s: float = 5e-5
    # Cores this pool's engine threads run on (a Linux cpu list, "2" or "2-3", or a list of
    # ints); () = wherever the OS puts them. Keep Ray's own processes off them by starting Ray
    # from a process that is (`pdserve serve --engine-cpus`, or `taskset`;
    # cluster/serving/cpu_affinity.py). Pinning alone, nothing reserved, already keeps a decode
    # step as fast served as alone on 2 cores (docs/findings.md).
    engine_cpus: CpuList = ()
    # Engine pools: make each step's text (detokenization, stop strings) and feed the token
    # streams on a thread of the replica's own while the engine runs the next step (True), or
    # on the engine thread after its step (False). None: on a GPU only, where the engine
    # thread's host time is the step's; on a CPU both threads want the same cores and the GIL
    # and the output thread overlaps nothing (cluster/engine/async_engine.py).
    output_thread: bool | None = None
    # Pools that prefill (prefill, colocated) with their prefix cache on: send a prompt to the
    # replica that was last sent the longest start of it (router/prefix_affinity.py), unless
    # that replica has more than `affinity_max_imbalance` requests open beyond the least loaded
    # one: queueing behind others can cost more than computing the prefix again elsewhere.
    # Off: Serve's power of two choices. The decode pool in disaggregated mode ignores both.
    prefix_affinity: bool = True
    affinity_max_imbalance: int = 2
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.gil_switch_interval_s <= 1:
            raise ConfigError("gil_switch_interval_s must be in (0, 1]")
        if self.torch_threads < 0:
            raise ConfigError("torch_threads must be >= 0")
        if self.affinity_max_imbalance < 0:
            raise ConfigError("affinity_max_imbalance must be >= 0")
        object.__setattr__(self, "engine_cpus", _cpu_list(self.engine_cpus))
        k = self.tensor_parallel_size
        if k not in TENSOR_PARALLEL_SIZES:
            raise ConfigError(
                f"tensor_parallel_size must be one of {TENSOR_PARALLEL_SIZES}, got {k}"
            )
        if k > 1 and self.num_cpus <= 0:
            raise ConfigError("tensor_parallel_size > 1 needs num_cpus > 0 (each rank's bundle)")
        if k > 1 and self.num_gpus not in ("auto", 0, 1):
            # The followers are processes of the replica's own, seeing the GPUs Ray granted it.
            raise ConfigError(
                f"tensor_parallel_size > 1 takes num_gpus 0 or 1 a rank, got {self.num_gpus}"
            )

    @property
    def ongoing_limit(self) -> int:
        return self.max_ongoing_requests or self.scheduler.max_num_seqs

    def serve_placement(self) -> dict[str, Any]:
        """At TP k > 1: a placement group per replica of k bundles, one per rank, each with a
        rank's CPUs and GPU, STRICT_PACK (one node). Serve places the replica's actor (rank 0)
        in the first bundle, which also holds the pool's custom resources; each other rank is a
        Ray actor the replica starts in its own bundle (`cluster.engine.tp_launch.BundleRanks`)."""
        k = self.tensor_parallel_size
        if k == 1:
            return {}
        gpus = self.actor_options()["num_gpus"]  # "auto" until the app is resolved
        gpus = gpus if gpus == "auto" else float(gpus)
        rank = {"CPU": self.num_cpus, **({"GPU": gpus} if gpus else {})}
        return {
            "placement_group_bundles": [{**rank, **dict(self.resources)}] + [rank] * (k - 1),
            "placement_group_strategy": TP_STRATEGY,
        }

    def output_thread_on(self, device: str) -> bool:
        """Whether this pool's engine replicas on `device` ("cpu", "cuda:0") run an output
        thread: `output_thread` if set, else only on a GPU."""
        if self.output_thread is not None:
            return self.output_thread
        return device.startswith("cuda")


# `PoolConfig`'s own fields: engine settings, which a router (no engine) refuses by name.
ENGINE_FIELDS = tuple(
    f.name for f in fields(PoolConfig) if f.name not in DeploymentConfig.__dataclass_fields__
)
