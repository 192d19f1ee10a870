"""Where a checkpoint's files are: a local directory as given, or a Hugging Face hub id
(`org/name`) resolved through `huggingface_hub` against its cache.

A hub id is looked up in the cache first (`HF_HOME` / `HF_HUB_CACHE`, no network), and
downloaded only when it is not there and the hub is reachable (`HF_HUB_OFFLINE` unset): only
the files the loader reads (config, tokenizer, safetensors). `pinned` fixes the revision to
the commit it resolved to, so every replica loads the same snapshot from its own node's cache,
without a network call where the CLI already resolved it. Every failure is one line
(InvalidArgument), fit for the CLI to print before Ray starts.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from cluster.config import ModelConfig
from cluster.errors import InvalidArgument

# What the loader and `describe_model` read; nothing else is downloaded (no .bin, .pth, .gguf).
CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken"]


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


def checkpoint_dir(model: ModelConfig) -> Path:
    """The local directory holding `model`'s checkpoint: `model.path` itself, or the snapshot
    of the hub id at `model.revision` (cache first, then downloaded unless offline). Raises
    InvalidArgument, one line, when there is none."""
    if not is_hub_id(model.path):
        local = Path(model.path).expanduser()
        if not local.is_dir():
            raise InvalidArgument(f"model {model.path}: no such directory", param="model")
        return local.absolute()
    return Path(_snapshot(model.path, model.revision or None))


def pinned(model: ModelConfig) -> ModelConfig:
    """`model` with a hub id's revision fixed to the commit its snapshot holds (resolving it
    with `checkpoint_dir`). A local path is returned unchanged and unchecked: on a cluster it
    may exist only on the engine nodes."""
    if not is_hub_id(model.path):
        return model
    return replace(model, revision=checkpoint_dir(model).name)


def _snapshot(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id
    where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
    try:
        return _complete(at, snapshot_download(
            repo_id, revision=revision, allow_patterns=CHECKPOINT_FILES, local_files_only=True
        ))  # fmt: skip
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise InvalidArgument(
                f"model {at}: not a directory, and not in {where} while HF_HUB_OFFLINE is set",
                param="model",
            ) from None
    try:
        return _complete(at, snapshot_download(
            repo_id, revision=revision, allow_patterns=CHECKPOINT_FILES
        ))  # fmt: skip
    except (RepositoryNotFoundError, GatedRepoError) as e:
        why = "gated: log in (HF_TOKEN) with access" if isinstance(e, GatedRepoError) else (
            "no such repository on the hub (or it is private: log in with HF_TOKEN)"
        )  # fmt: skip
        raise InvalidArgument(f"model {at}: not a directory; {why}", param="model") from None
    except RevisionNotFoundError:
        raise InvalidArgument(f"model {at}: no such revision", param="model") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidArgument(
            f"model {at}: not a directory, not in {where}, and the download failed: {first}",
            param="model",
        ) from None


def _complete(at: str, snapshot: str) -> str:
    """The snapshot, if it has a config (a cache entry of some other file is not a model)."""
    if not (Path(snapshot) / "config.json").is_file():
        raise InvalidArgument(f"model {at}: the snapshot {snapshot} has no config.json")
    return snapshot
