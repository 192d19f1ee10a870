"""The KV transports, each declared once: its name, its capabilities and the package that
builds its two ends. Every other place that needs a transport's name reads it here: `KVHandle`
validation, `AppConfig` (the names it accepts, what "auto" picks, which need a GPU), the
collective channel, the decode worker's client (`transport_factory.make_kv_client`) and the
prefill worker's KV server (`transport_factory.make_senders`).

A transport's package is named by its dotted path, not imported here: the registry imports no
transport, so a transport may import the registry and nothing outside its folder imports a
transport. The package provides two factories (contracts in `base`):

    make_client(parts: ClientParts) -> KVClient       # the decode side
    make_sender(parts: SenderParts) -> KVSender       # the prefill side: its RPC handlers

Either may raise Unavailable when the transport cannot run in this process: the decode side
then uses the `BASELINE` transport's client, the prefill side serves the baseline alone (every
KV server serves it, so every handle can still be fetched).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from cluster.errors import InvalidArgument

BASELINE = "grpc"  # served by every KV server; what a transport that cannot run falls back to


@dataclass(frozen=True)
class Transport:
    """One KV transport. `package` holds `make_client` and `make_sender`; `needs_cuda`: it
    moves KV between GPUs only (a CPU model is refused when the app is built); `probe`, as
    "module:function", makes it a candidate for transport "auto": the function returns why the
    transport cannot run here ("" when it can). Candidates are tried in registration order."""

    name: str
    package: str
    needs_cuda: bool = False
    probe: str = ""


_TRANSPORTS: dict[str, Transport] = {}


def register(transport: Transport) -> None:
    """Declare `transport` (InvalidArgument if its name is taken or reserved)."""
    if transport.name in _TRANSPORTS or transport.name in ("", "auto"):
        raise InvalidArgument(f"KV transport name {transport.name!r} is taken")
    _TRANSPORTS[transport.name] = transport


def unregister(name: str) -> None:
    """Forget a transport registered at run time (tests); the built-in ones stay."""
    if name == BASELINE:
        raise InvalidArgument(f"transport {BASELINE!r} is the baseline")
    _TRANSPORTS.pop(name, None)


def names() -> tuple[str, ...]:
    """Every registered transport's name, in registration order."""
    return tuple(_TRANSPORTS)


def get(name: str) -> Transport:
    """The transport called `name`; InvalidArgument naming the registered ones if none is."""
    try:
        return _TRANSPORTS[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown KV transport {name!r}; one of {names()}", param="transport"
        ) from None


def package(name: str) -> ModuleType:
    """The imported package of transport `name` (with `make_client` and `make_sender`)."""
    return importlib.import_module(get(name).package)


def served_by(package_name: str) -> tuple[str, ...]:
    """The names of the transports whose package is `package_name`."""
    return tuple(t.name for t in _TRANSPORTS.values() if t.package == package_name)


def choose_auto() -> tuple[str, list[str]]:
    """What transport "auto" stands for here: the first candidate whose probe passes, else the
    baseline; and why each candidate tried before it could not run."""
    why_not = []
    for t in _TRANSPORTS.values():
        if not t.probe:
            continue
        module, function = t.probe.split(":")
        reason = getattr(importlib.import_module(module), function)()
        if not reason:
            return t.name, why_not
        why_not.append(f"{t.name}: {reason}")
    return BASELINE, why_not


# The built-in transports, one line each. A new one: a folder beside these and a line here.
register(Transport("grpc", "cluster.kv_transfer.grpc"))
register(Transport("nixl", "cluster.kv_transfer.nixl", probe=f"{__package__}.nixl.nixl_pool:probe"))
register(Transport("gloo", "cluster.kv_transfer.collective"))
register(Transport("nccl", "cluster.kv_transfer.collective", needs_cuda=True))
