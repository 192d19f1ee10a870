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


class FakeHub:
    """The hub, as `huggingface_hub` is asked about it, with no network: `model_info` answers
    for `repo_id` from a checkpoint on disk (`source`), and `snapshot_download` "downloads"
    the files of `source` that the call's patterns match into the cache, as the real one lays
    them out. Every call is recorded; a cache-only call (`local_files_only`) goes to the real
    function, which reads the cache."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hub_cache: Path, source: Path) -> None:
        import huggingface_hub

        self.hub_cache, self.source = hub_cache, source
        self.commit = hashlib.sha1(b"fake-hub").hexdigest()
        self.info_calls: list[tuple[str, str | None]] = []
        self.downloads: list[list[str]] = []  # the allow_patterns of each download
        self.info_error: Exception | None = None
        self._real = huggingface_hub.snapshot_download
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)
        monkeypatch.setattr(
            huggingface_hub.HfApi, "model_info", lambda api, *a, **k: self._model_info(*a, **k)
        )

    def _model_info(self, repo_id: str, *, revision: str | None = None, **_):
        from types import SimpleNamespace

        self.info_calls.append((repo_id, revision))
        if self.info_error is not None:
            raise self.info_error
        files = [p.name for p in sorted(self.source.iterdir())]
        return SimpleNamespace(
            sha=self.commit, siblings=[SimpleNamespace(rfilename=f) for f in files]
        )

    def snapshot_download(self, repo_id: str, revision: str | None = None, **kw) -> str:
        import fnmatch
        import shutil

        if kw.get("local_files_only"):
            return self._real(repo_id, revision=revision, **kw)
        patterns = list(kw.get("allow_patterns") or ["*"])
        self.downloads.append(patterns)
        repo = self.hub_cache / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / self.commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in self.source.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in patterns):
                shutil.copy(f, snapshot / f.name)
        if revision != self.commit:
            (repo / "refs").mkdir(exist_ok=True)
            (repo / "refs" / (revision or "main")).write_text(self.commit)
        return str(snapshot)

    def weights_downloaded(self) -> bool:
        """Whether any download asked for weight files."""
        return any(p in ("*", "*.safetensors") for ps in self.downloads for p in ps)


def hub_error(cls: type[Exception], message: str = "404") -> Exception:
    """An error of `huggingface_hub`'s of class `cls`, made without an HTTP response (their
    constructors differ between releases; pdserve only tells them apart by class)."""
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    return e
