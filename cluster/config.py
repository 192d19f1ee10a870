"""Frozen, validated configuration, composed at the top; each component gets only its slice.

Each config is a frozen dataclass that checks itself when it is built. Its dict form (YAML,
JSON, a Serve config file's `args`) is validated by pydantic in strict mode before anything is
built (`parse_config`): unknown keys and wrong types are refused, each error naming its field
path (`prefill.cache.num_blocks: expected an integer, got "1024"`). `config_schema` is the
JSON schema of that form, `dump_config` writes it.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import typing
from dataclasses import dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import pydantic
from pydantic import BeforeValidator, ConfigDict, with_config
from pydantic_core import core_schema

from cluster.errors import InvalidArgument

if typing.TYPE_CHECKING:
    import torch

TransportName = Literal["auto", "grpc", "nixl", "gloo", "nccl"]
TRANSPORTS = ("auto", "grpc", "nixl", "gloo", "nccl")
# The weights' and KV cache's dtypes, named as torch names them (torch is imported when one is
# used, so that reading a config does not load torch); "auto" is decided by `on_device`.
_DTYPES = ("auto", "bfloat16", "float16", "float32")
# The scheduler's token budget per step when none is given: a GPU wants large prefill chunks
# (vLLM's default for online serving), the CPU gets short steps so decodes are not held up.
GPU_BATCHED_TOKENS = 8192
CPU_BATCHED_TOKENS = 512
# The dict form has JSON's types, exactly: an integer is never "1024" nor 2.5, a flag is true
# or false (never "no"), a number may be written as an integer. No key is ignored.
DICT_FORM = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
C = TypeVar("C")


class ConfigError(InvalidArgument, ValueError):
    """A value a config dataclass's own checks refuse. Also a ValueError, so that pydantic
    reports it at the path of the part that refused it."""


class NamedNumbers:
    """Pydantic marker of a `tuple[tuple[str, float], ...]` field (sorted (name, number) pairs:
    hashable, so the dataclass stays frozen). Its dict form is a mapping of names to numbers,
    the names limited to `names` when given."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.names = names

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        keys = core_schema.literal_schema(list(self.names)) if self.names else None
        mapping = core_schema.dict_schema(
            keys or core_schema.str_schema(), core_schema.float_schema()
        )
        return core_schema.no_info_after_validator_function(
            lambda d: tuple(sorted(d.items())),
            mapping,
            serialization=core_schema.plain_serializer_function_ser_schema(
                dict, return_schema=mapping
            ),
        )


Resources = Annotated[tuple[tuple[str, float], ...], NamedNumbers()]


def byte_size(value: Any) -> int:
    """Bytes from an int or a string such as "4GiB", "512MiB", "2G" or "1e9" (the dict form of
    `CacheConfig.kv_cache_memory`, and its flag): K/M/G/T powers of 1000, Ki/Mi/Gi/Ti of 1024."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE]\d+)?)\s*(?:([KMGT])(i?))?[bB]?\s*", str(value))
    if isinstance(value, bool) or m is None:
        raise ConfigError(f"expected a size in bytes such as 4GiB, got {value!r}")
    power = "KMGT".index(m.group(2)) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


# In the dict form an integer of bytes or a string such as "4GiB".
ByteSize = Annotated[int, BeforeValidator(byte_size, json_schema_input_type=int | str)]


def default_served_name(path: str) -> str:
    """The name clients call a model by when none is given: a hub id as is, a directory's name."""
    local = Path(path).expanduser()
    if path.startswith(("/", ".", "~")) or local.is_dir():
        return local.name
    return path.strip("/")


@with_config(DICT_FORM)
@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load, and where it runs. `path` is a Hugging Face checkpoint
    directory or a hub id (`org/name`, resolved by `cluster.model.hub`: the local cache first,
    downloaded when online; `revision` a branch, tag or commit, "" = main). `served_name` is
    what clients call the model (OpenAI `model`, metrics' `model_name`); "" = the hub id, or
    the directory's name. `device`/`dtype` "auto" are decided by `on_device` (cuda + bfloat16
    where there is a GPU, else cpu + float32) where the engine runs: in each engine replica."""

    path: str
    served_name: str = ""
    revision: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    # A context longer than the checkpoint's max_position_embeddings is refused; 0 = use it.
    max_model_len: int = 0
    # fp32 on the CPU: also keep every linear weight packed for MKL's GEMM
    # (cluster/model/linear.py), which makes the GEMMs of decode batches of 4-96 sequences
    # faster and costs about as much memory again as the weights.
    packed_weights: bool = True
    # On a GPU (Triton attention path) decode steps replay CUDA graphs captured per batch-size
    # bucket (cluster/engine/cuda_graphs.py); false: all eager (vLLM's --enforce-eager).
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len < 0:
            raise ConfigError("max_model_len must be >= 0")
        if not self.served_name:
            object.__setattr__(self, "served_name", default_served_name(self.path))

    def on_device(self, cuda: bool | None = None) -> ModelConfig:
        """This config with `device` and `dtype` "auto" made concrete: cuda and bfloat16 if
        `cuda` (None: if torch sees a GPU), else cpu and float32; an explicit device keeps its
        dtype rule. An engine replica decides where it runs (`cluster.serving.replica_device`)."""
        if "auto" not in (self.device, self.dtype):
            return self
        if cuda is None and self.device == "auto":
            import torch

            cuda = torch.cuda.is_available()
        device = ("cuda" if cuda else "cpu") if self.device == "auto" else self.device
        dtype = self.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        return replace(self, device=device, dtype=dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.on_device().dtype)


@with_config(DICT_FORM)
@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens each, in every layer.

    Without `num_blocks` the pool is sized when the engine is built, after its weights are
    loaded (`cluster.engine.kv_cache.kv_pool_blocks`): `kv_cache_memory` bytes if given; else
    on a GPU what `gpu_memory_utilization` of its memory leaves after everything in use (the
    weights, other processes) and an activation reserve; else, on the CPU, `CPU_KV_BLOCKS`."""

    block_size: int = 16
    num_blocks: int | None = None
    # Fraction of the GPU's memory this engine may fill, weights and activations included.
    gpu_memory_utilization: float = 0.9
    # Bytes for the KV pool (the CPU's way of sizing it; on a GPU it overrides the fraction).
    kv_cache_memory: ByteSize = 0
    # Keep the KV of finished prompts' full blocks, reclaimable, and reuse it for any later
    # prompt that starts with the same tokens (cluster/engine/block_manager.py).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        object.__setattr__(self, "kv_cache_memory", byte_size(self.kv_cache_memory))


@with_config(DICT_FORM)
@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step may take on."""

    max_num_seqs: int = 128  # running sequences at once
    # Token budget per step; longer prompts are chunked. None = by device (`for_device`).
    max_num_batched_tokens: int | None = None
    max_waiting: int = 4096  # admission queue bound; beyond it requests are refused

    def __post_init__(self) -> None:
        tokens = self.max_num_batched_tokens
        if self.max_num_seqs <= 0 or (tokens is not None and tokens <= 0) or self.max_waiting <= 0:
            raise ConfigError("scheduler limits must be positive")

    def for_device(self, device: str) -> SchedulerConfig:
        """The token budget filled in for `device` if none was given: `GPU_BATCHED_TOKENS` on
        a GPU, `CPU_BATCHED_TOKENS` on the CPU; still None for "auto" (decided with it)."""
        if self.max_num_batched_tokens is not None or device == "auto":
            return self
        tokens = GPU_BATCHED_TOKENS if device.startswith("cuda") else CPU_BATCHED_TOKENS
        return replace(self, max_num_batched_tokens=tokens)


@with_config(DICT_FORM)
@dataclass(frozen=True)
class TransferConfig:
    """How KV moves from a prefill worker to a decode worker.

    `secret` keys the HMAC capability tokens; every worker of one cluster must share it (the app
    builder generates one when it is empty). `host` is the address the prefill worker's KV
    server, the router's token stream server and direct endpoint bind and advertise ("auto" =
    this node's Ray address, never a wildcard); port 0 picks a free port (token streams: always).

    `transport` "auto" is decided when the app is built (`AppConfig.resolved`): "nixl" where
    NIXL imports and two agents move bytes to each other, else "grpc". `checksum` adds a
    checksum of every gRPC chunk, computed by the sender and checked by the receiver (headers
    and shapes are always checked); off, the chunk bytes are not read beyond their copies."""

    transport: TransportName = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    lease_seconds: float = 30.0
    # Both ends raise gRPC's message limit to this plus framing; 4 MiB measured fastest on
    # loopback.
    max_chunk_bytes: int = 4 << 20
    fetch_timeout_seconds: float = 30.0
    # A decode worker's channel to a prefill worker (gRPC; gloo/nccl: the pair's process group)
    # is closed after this long unused (gRPC: and at least fetch_timeout_seconds).
    channel_idle_seconds: float = 60.0
    secret: str = ""
    checksum: bool = False

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if min(self.lease_seconds, self.fetch_timeout_seconds, self.channel_idle_seconds) <= 0:
            raise ConfigError("lease_seconds, fetch_timeout_seconds, channel_idle_seconds: > 0")
        if not 4096 <= self.max_chunk_bytes <= 64 << 20:
            raise ConfigError("max_chunk_bytes must be in [4 KiB, 64 MiB]")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port out of range: {self.port}")
        if self.host in ("", "0.0.0.0", "::"):  # internal servers never face every network
            raise ConfigError("host: this node's cluster address or auto, not every interface")


def resolve_host(host: str) -> str:
    """The address to bind and advertise for `host`: "auto" is this node's Ray address."""
    if host != "auto":
        return host
    import socket

    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    default_max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.default_max_tokens <= 0:
            raise ConfigError("default_max_tokens must be positive")

    def resolved(self) -> EngineConfig:
        """Device, dtype and the token budget made concrete (`ModelConfig.on_device`,
        `SchedulerConfig.for_device`); the same config when they already are."""
        model = self.model.on_device()
        scheduler = self.scheduler.for_device(model.device)
        if model is self.model and scheduler is self.scheduler:
            return self
        return replace(self, model=model, scheduler=scheduler)


# -- the dict form ---------------------------------------------------------------------------


def parse_config(cls: type[C], data: Any) -> C:
    """`cls` (a config dataclass) from its dict form, validated strictly; every problem is
    reported, each with its field path, as one INVALID_ARGUMENT."""
    _check_json_types(data, [])
    try:
        return _adapter(cls).validate_json(json.dumps(data))
    except pydantic.ValidationError as e:
        errors = e.errors()
        first = _path([p for p in errors[0]["loc"] if p != "[key]"]) or None
        problems = "; ".join(_describe(cls, err) for err in errors)
        raise InvalidArgument(problems, param=first) from None


def dump_config(config: Any) -> dict[str, Any]:
    """The dict form of a config dataclass (plain JSON types); `parse_config` reads it back."""
    return _adapter(type(config)).dump_python(config, mode="json")


def config_schema(cls: type) -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of `cls`'s dict form."""
    schema = _adapter(cls).json_schema()
    _mapping_defaults(schema)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


@functools.cache
def _adapter(cls: type) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(cls)


def _check_json_types(value: Any, loc: list[str | int]) -> None:
    """The dict form holds only what JSON holds (YAML can also write dates, sets, ...)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidArgument(f"{_path([*loc, str(k)])}: keys must be strings")
            _check_json_types(v, [*loc, k])
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_json_types(v, [*loc, i])
    elif value is not None and not isinstance(value, str | int | float):
        where = _path(loc) or "config"
        raise InvalidArgument(f"{where}: {type(value).__name__} is not a config value")


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "dataclass_type": "a mapping",
    "list_type": "a list",
    "tuple_type": "a list",
    "finite_number": "a finite number",
}


def _describe(cls: type, error: Any) -> str:
    """One validation error as `field.path: what is wrong`."""
    loc, kind, ctx = list(error["loc"]), error["type"], error.get("ctx") or {}
    if loc and loc[-1] == "[key]":  # a name outside a NamedNumbers' names
        return f"{_path(loc[:-1])}: unknown key, expected {ctx['expected']}"
    where = _path(loc) or cls.__name__
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        return f"{where}: unknown key{_known_keys(cls, loc)}"
    if kind in ("missing", "missing_argument"):
        return f"{where}: required"
    if kind == "value_error":  # a dataclass's own check; its message may name the field
        message = str(getattr(ctx.get("error"), "message", ctx.get("error")))
        if not loc:
            return message
        return f"{where}: {message.removeprefix(f'{loc[-1]}: ')}"
    expected = ctx["expected"] if kind == "literal_error" else _EXPECTED.get(kind)
    if expected is None:
        return f"{where}: {error['msg']}"
    return f"{where}: expected {expected}, got {json.dumps(error['input'])[:80]}"


def _known_keys(cls: type, loc: list) -> str:
    """ " (did you mean 'x'?)" or the keys the dataclass at `loc[:-1]` takes."""
    for name in loc[:-1]:
        hint = typing.get_type_hints(cls).get(name)
        found = [t for t in (hint, *typing.get_args(hint)) if is_dataclass(t)]
        if not found:
            return ""
        cls = found[0]
    if loc[-1] in (refused := getattr(cls, "REFUSED_KEYS", {})):  # a reason for refusing it
        return f" ({refused[loc[-1]]})"
    keys = list(cls.__dataclass_fields__)
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
    return (
        f" (did you mean {close[0]!r}?)" if close else f" ({cls.__name__} keys: {', '.join(keys)})"
    )


def _path(loc: Any) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _mapping_defaults(node: Any) -> None:
    """A NamedNumbers default is an empty mapping in the dict form, not pydantic's `[]`."""
    if isinstance(node, dict):
        if node.get("type") == "object" and node.get("default") == []:
            node["default"] = {}
        for v in node.values():
            _mapping_defaults(v)
    elif isinstance(node, list):
        for v in node:
            _mapping_defaults(v)
