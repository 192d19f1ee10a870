"""The real `Orchestrator` at hop 1 (the tiny checkpoint's real tokenizer, no pools), for the
fuzz tests of the router's conversions: `ConvertOnly` builds and validates every `Request`
exactly as the router does, then answers from `FakeService`'s canned tokens instead of the
pools, recording each request it was given."""

from __future__ import annotations

from pathlib import Path

from cluster.config import ModelConfig, TransferConfig
from cluster.model.info import describe_model
from cluster.request import Request
from cluster.serving.app_config import AppConfig
from router.orchestrator import Orchestrator
from tests.router.fake_service import FakeService


class ConvertOnly:
    def __init__(self, model_dir: Path) -> None:
        model = ModelConfig(path=str(model_dir))
        config = AppConfig(model=model, transfer=TransferConfig(secret="5e" * 32))
        self._orch = Orchestrator(config, describe_model(model), None, None, None, None)
        self._fake = FakeService()
        self.requests: list[Request] = []

    def __getattr__(self, name: str):
        return getattr(self._orch, name)

    def generate(self, request: Request):
        self.requests.append(request)
        return self._fake.generate(request)
