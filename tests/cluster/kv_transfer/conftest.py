"""Fixtures of the KV transfer tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def llama_dir(model_dir) -> Path:
    """The shared tiny Llama (GQA) checkpoint of tests/conftest.py."""
    return model_dir("llama-gqa")
