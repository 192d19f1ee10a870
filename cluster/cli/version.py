"""`package_version`: pdserve's version, for `pdserve --version` (main.py) and the metadata of a
bench report (bench.py). Its own module so that neither verb imports the other."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path


def package_version() -> str:
    """pdserve's version: the installed package's, else the source tree's pyproject.toml."""
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"
