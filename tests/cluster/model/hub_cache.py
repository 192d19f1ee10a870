"""A Hugging Face hub cache made on disk, as `huggingface_hub` lays one out, holding a checkpoint
the project's own writer (`make_model`) made: no network anywhere."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from cluster.model.make_model import make_model

REPO_ID = "pdserve-test/tiny-llama"


def make_hub_cache(hub_cache: Path, repo_id: str = REPO_ID, seed: int = 0) -> Path:
    """`<hub_cache>/models--org--name/snapshots/<commit>/` with a tiny checkpoint and
    `refs/main` naming the commit; returns the snapshot directory."""
    commit = hashlib.sha1(f"{repo_id}:{seed}".encode()).hexdigest()  # 40 hex, as git's
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = make_model("tiny", repo / "snapshots" / commit, seed=seed)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def hub_env(home: Path, offline: bool = True) -> dict[str, str]:
    """The environment that points `huggingface_hub` at `home` (a child process reads it)."""
    return {
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_HUB_OFFLINE": "1" if offline else "0",
    }


def use_hub_cache(monkeypatch: pytest.MonkeyPatch, home: Path, offline: bool = True) -> None:
    """Point this process's `huggingface_hub` at `home`: the environment, and the constants
    it read from the environment when it was imported."""
    from huggingface_hub import constants

    for key, value in hub_env(home, offline).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
