"""A colocated worker for tests/e2e/test_hub_loading.py: its engine starts `DELAY_S` later
(standing in for a hub download of that length; the download itself is the unit tests'), and
it tells what hub environment its process got (the token as a digest)."""

from __future__ import annotations

import hashlib
import os
import time

import cluster.serving.replica as replica
from decode_worker.colocated_worker import ColocatedWorker

DELAY_S = 8.0


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class SlowStartWorker(ColocatedWorker):
    async def __init__(self, config) -> None:
        real = replica.MeteredEngine

        class SlowEngine(real):
            def __init__(self, engine_config) -> None:
                time.sleep(DELAY_S)
                super().__init__(engine_config)

        replica.MeteredEngine = SlowEngine  # this replica's process only
        try:
            await super().__init__(config)
        finally:
            replica.MeteredEngine = real

    async def hub_env(self) -> dict[str, str]:
        token = os.environ.get("HF_TOKEN", "")
        return {
            "HF_TOKEN": digest(token) if token else "",
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", ""),
        }
