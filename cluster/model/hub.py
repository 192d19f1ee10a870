"""Where a checkpoint's files are: a local directory as given, or a Hugging Face hub id
(`org/name`) resolved through `huggingface_hub` against its cache.

A hub id is looked up in the cache first (`HF_HOME` / `HF_HUB_CACHE`, no network), and
downloaded only when it is not there and the hub is reachable (`HF_HUB_OFFLINE` unset): only
the files the loader reads, `CONFIG_FILES` (config, generation config, tokenizer, chat
template, the weight index) and, where the weights are wanted, `WEIGHT_FILES`.

On a cluster the machine that builds the application never downloads weights: `pinned` fixes
the revision to the commit the hub names for it (`HfApi.model_info(...).sha`; offline, or with
the hub out of reach, the commit the cache's refs name), and the builder's checks read only
`CONFIG_FILES` (`checkpoint_dir(model, weights=False)`). Each engine replica then downloads
that commit's weights into its own node's cache when it starts (`checkpoint_dir`, from the
loader). Every failure is one line (InvalidArgument), fit for the CLI to print before Ray
starts.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from cluster.config import ModelConfig
from cluster.errors import InvalidArgument

# What `describe_model` reads (config.json, generation_config.json, the tokenizer's files, a
# chat template, model.safetensors.index.json): all a router, and a builder's checks, need.
CONFIG_FILES = ["*.json", "tokenizer.model", "*.txt", "*.tiktoken", "*.jinja"]
# What only the loader reads. Nothing else is downloaded (no .bin, .pth, .gguf).
WEIGHT_FILES = ["*.safetensors"]
CHECKPOINT_FILES = CONFIG_FILES + WEIGHT_FILES
# A full git commit id: a revision that already is one needs no lookup.
COMMIT_ID = re.compile(r"[0-9a-f]{40}")


def is_hub_id(path: str) -> bool:
    """`path` names a hub repository rather than a local directory: not an existing
    directory, not written as a path (/, ., ~), and a valid repo id (`name` or `org/name`)."""
    if not path or path.startswith(("/", ".", "~")) or Path(path).is_dir():
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def checkpoint_dir(model: ModelConfig, weights: bool = True) -> Path:
    """The local directory holding `model`'s checkpoint: `model.path` itself, or the snapshot
    of the hub id at `model.revision` (cache first, then downloaded unless offline), with its
    weights, or with `CONFIG_FILES` only when `weights` is False. Raises InvalidArgument, one
    line, when there is none."""
    if not is_hub_id(model.path):
        local = Path(model.path).expanduser()
        if not local.is_dir():
            raise InvalidArgument(f"model {model.path}: no such directory", param="model")
        return local.absolute()
    return Path(_snapshot(model.path, model.revision or None, weights))


def pinned(model: ModelConfig) -> ModelConfig:
    """`model` with a hub id's revision fixed to the commit it names now (`commit_of`), so
    every replica loads the same files. Downloads nothing. A local path is returned unchanged
    and unchecked: on a cluster it may exist only on the engine nodes."""
    if not is_hub_id(model.path):
        return model
    return replace(model, revision=commit_of(model.path, model.revision or None))


def commit_of(repo_id: str, revision: str | None) -> str:
    """The commit `revision` (None: main) of `repo_id` names, without downloading a file: a
    full commit id as given; else the hub's answer (which also confirms the repository has
    safetensors weights); offline (`HF_HUB_OFFLINE`) or with the hub out of reach, the commit
    of the cached snapshot the cache's refs name."""
    if revision and COMMIT_ID.fullmatch(revision):
        return revision
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id
    unreachable = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else ""
    if not unreachable:
        try:
            info = HfApi().model_info(repo_id, revision=revision)
        except (RepositoryNotFoundError, GatedRepoError) as e:
            raise InvalidArgument(f"model {at}: not a directory; {_denied(e)}", "model") from None
        except RevisionNotFoundError:
            raise InvalidArgument(f"model {at}: no such revision", param="model") from None
        except Exception as e:  # the hub is out of reach (connection, timeout, 5xx): the cache
            unreachable = f"the hub is out of reach: {_first_line(e)}"
        else:
            names = [s.rfilename for s in info.siblings or []]
            if info.siblings is not None and not any(n.endswith(".safetensors") for n in names):
                raise InvalidArgument(
                    f"model {at}: the repository has no safetensors weights", param="model"
                )
            return str(info.sha)
    try:
        return Path(_cached(repo_id, revision)).name
    except _NotCached:
        raise InvalidArgument(
            f"model {at}: not a directory, and not in {_where()} while {unreachable}",
            param="model",
        ) from None


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards of its index, or its one file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise InvalidArgument(f"{path} has no model.safetensors or model.safetensors.index.json")


class _NotCached(Exception):
    pass


def _snapshot(repo_id: str, revision: str | None, weights: bool) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id
    patterns = CHECKPOINT_FILES if weights else CONFIG_FILES
    try:
        cached: str | None = _cached(repo_id, revision, patterns)
    except _NotCached:
        cached = None
    # A snapshot whose config alone was fetched here (a builder's check on this node) is not
    # the checkpoint: its weights are still to download.
    if cached is not None and (not weights or _has_weights(Path(cached))):
        return _complete(at, cached, weights)
    if constants.HF_HUB_OFFLINE:
        where = f"not in {_where()}" if cached is None else f"{_where()} has no weights of it"
        raise InvalidArgument(
            f"model {at}: not a directory, and {where} while HF_HUB_OFFLINE is set",
            param="model",
        )
    try:
        return _complete(at, snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns
        ), weights)  # fmt: skip
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise InvalidArgument(f"model {at}: not a directory; {_denied(e)}", "model") from None
    except RevisionNotFoundError:
        raise InvalidArgument(f"model {at}: no such revision", param="model") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise InvalidArgument(
            f"model {at}: not a directory, not in {_where()}, and the download failed: "
            f"{_first_line(e)}",
            param="model",
        ) from None


def _cached(repo_id: str, revision: str | None, patterns: list[str] = CONFIG_FILES) -> str:
    """The cached snapshot of `revision` (its refs, or the commit itself), with no network
    call; raises _NotCached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns, local_files_only=True
        )
    except LocalEntryNotFoundError:
        raise _NotCached from None


def _has_weights(snapshot: Path) -> bool:
    try:
        return all(f.is_file() for f in weight_files(snapshot))
    except InvalidArgument:
        return False


def _complete(at: str, snapshot: str, weights: bool) -> str:
    """The snapshot, if it has a config (a cache entry of some other file is not a model) and,
    where they are wanted, its weights."""
    if not (Path(snapshot) / "config.json").is_file():
        raise InvalidArgument(f"model {at}: the snapshot {snapshot} has no config.json")
    if weights and not _has_weights(Path(snapshot)):
        raise InvalidArgument(f"model {at}: the snapshot {snapshot} has no safetensors weights")
    return snapshot


def _where() -> str:
    from huggingface_hub import constants

    return f"the Hugging Face cache ({constants.HF_HUB_CACHE})"


def _denied(e: Exception) -> str:
    from huggingface_hub.errors import GatedRepoError

    if isinstance(e, GatedRepoError):
        return "gated: log in (HF_TOKEN) with access"
    return "no such repository on the hub (or it is private: log in with HF_TOKEN)"


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
