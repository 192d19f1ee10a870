"""Client API keys: who may call the cluster's client-facing entry points (Serve's gRPC and
HTTP proxies, the routers' direct endpoints; docs/deployment.md, "Trust boundary").

`ApiKey` holds one key and never shows it: its repr, str, and its dict form (a config dumped
with `dump_config`) are `REDACTED`, which is not a valid key, so a dumped config read back
refuses it instead of taking the placeholder for a key. `ClientAuth` is the router config's
part that names the keys (`api_keys`, `api_key_file`, and `$PDSERVE_API_KEY`, read when the
app is built: `with_keys_loaded`) and the direct endpoint's TLS files. `ApiKeys.check` is the
one comparison (`hmac.compare_digest` against every key, so its time does not say which key
came close). No message here ever quotes a key or a line of the key file.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

from pydantic import with_config
from pydantic_core import core_schema

from cluster.config import DICT_FORM, ConfigError
from cluster.errors import Unauthenticated

ENV_VAR = "PDSERVE_API_KEY"
REDACTED = "<redacted>"
MAX_KEY_CHARS = 512
MAX_KEY_FILE_BYTES = 1 << 20
# RFC 6750's b64token, what may follow "Bearer " in an Authorization header.
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] +(\S+) *")


class ApiKey:
    """One client API key (RFC 6750 token characters, at most `MAX_KEY_CHARS`). Shown as
    `ApiKey(<redacted>)` everywhere; `reveal` is the only way to the key."""

    __slots__ = ("_key",)

    def __init__(self, key: str) -> None:
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise ConfigError(f"an API key must be a string of 1-{MAX_KEY_CHARS} characters")
        if not _TOKEN.fullmatch(key):
            raise ConfigError(
                "an API key may hold only letters, digits and -._~+/ (then = padding)"
            )
        self._key = key

    def reveal(self) -> str:
        return self._key

    def __repr__(self) -> str:
        return f"ApiKey({REDACTED})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ApiKey):
            return NotImplemented
        return hmac.compare_digest(self._key.encode(), other._key.encode())

    def __hash__(self) -> int:
        return hash(hashlib.sha256(self._key.encode()).digest())

    def __reduce__(self) -> tuple[Any, ...]:  # configs cross Ray processes pickled
        return (ApiKey, (self._key,))

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        # Dict form: the key as a string; dumped: REDACTED.
        return core_schema.no_info_after_validator_function(
            _as_key,
            core_schema.str_schema(),
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda _key: REDACTED, return_schema=core_schema.str_schema()
            ),
        )


def _as_key(value: str) -> ApiKey:
    try:
        return ApiKey(value)
    except ConfigError as e:
        raise ValueError(e.message) from None  # pydantic reports it at the field's path


def read_key_file(path: str | Path) -> tuple[ApiKey, ...]:
    """The keys in `path`: one a line; blank lines and lines starting with # are skipped.
    Refused (ConfigError, naming the line number only) when unreadable, over
    `MAX_KEY_FILE_BYTES`, or when a line is not a key."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"api_key_file {str(path)!r}: {e.strerror}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"api_key_file {str(path)!r}: larger than {MAX_KEY_FILE_BYTES} bytes")
    keys = []
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            keys.append(ApiKey(line))
        except ConfigError as e:
            raise ConfigError(f"api_key_file {str(path)!r}, line {number}: {e.message}") from None
    if not keys:
        raise ConfigError(f"api_key_file {str(path)!r} holds no key")
    return tuple(keys)


def env_keys(environ: dict[str, str] | None = None) -> tuple[ApiKey, ...]:
    """The key in `$PDSERVE_API_KEY` (none when unset or empty)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not value:
        return ()
    try:
        return (ApiKey(value),)
    except ConfigError as e:
        raise ConfigError(f"${ENV_VAR}: {e.message}") from None


@with_config(DICT_FORM)
@dataclass(frozen=True)
class ClientAuth:
    """The router's client authentication and the direct endpoint's TLS (the first base of
    `RouterConfig`, so its fields are the router's: `router.api_keys`, ...).

    With any key, every call on Serve's proxies and the routers' direct endpoints must carry
    one: `Authorization: Bearer KEY` (HTTP header, or gRPC metadata `authorization`), else
    UNAUTHENTICATED / 401; `GET /health` stays open. Keys come from `api_keys`, from
    `api_key_file` and from `$PDSERVE_API_KEY`, the last two read where the app is built
    (`with_keys_loaded`): keep keys out of Serve config files, which Serve shows to anyone
    who reaches its dashboard. `tls_cert_file`/`tls_key_file` (PEM, read by each router
    replica on its node) put the direct endpoint behind TLS; Serve's proxies take no TLS of
    pdserve's (terminate it in front of them)."""

    api_keys: tuple[ApiKey, ...] = ()
    api_key_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)  # cooperative: RouterConfig's next base
        if parent is not None:
            parent()
        keys = tuple(k if isinstance(k, ApiKey) else ApiKey(k) for k in self.api_keys)
        object.__setattr__(self, "api_keys", tuple(dict.fromkeys(keys)))
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file go together: give both or neither")

    def with_keys_loaded(self, environ: dict[str, str] | None = None) -> Self:
        """This config with the keys of `api_key_file` and `$PDSERVE_API_KEY` added to
        `api_keys` (read here, once, where the app is built; the replicas read neither)."""
        found = read_key_file(self.api_key_file) if self.api_key_file else ()
        return replace(self, api_keys=(*self.api_keys, *found, *env_keys(environ)))


class ApiKeys:
    """The check every entry point makes (router/api_key_auth.py): no keys, nothing is
    checked; else the caller's `Authorization` value must be `Bearer` and one of them."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self._keys = tuple(k.reveal().encode() for k in keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | bytes | None) -> None:
        """Raise `Unauthenticated` unless `authorization` (the header's value) carries a key."""
        if not self._keys:
            return
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        if not authorization:
            raise Unauthenticated("missing API key: send the header Authorization: Bearer KEY")
        match = _BEARER.fullmatch(authorization)
        if match is None:
            raise Unauthenticated("the Authorization header must be: Bearer KEY")
        presented = match.group(1).encode("utf-8", "replace")
        found = False
        for key in self._keys:  # every key compared: no early exit
            found |= hmac.compare_digest(presented, key)
        if not found:
            raise Unauthenticated("invalid API key")
