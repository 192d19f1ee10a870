"""`KVChannelCache`: the open `KVChannel`s of one worker, by key, closed once idle.

Both ends of the direct KV transports keep one: the prefill side keys channels by channel id,
the decode side by the prefill worker's endpoint. A channel is evicted (removed, then closed)
when it has carried nothing for `idle_seconds` and no transfer holds it (`busy == 0`); a closed
channel is dropped the next time it is looked up. `on_evict(key, channel)` runs after an idle
eviction (the decode side tells the prefill side). Runs on one event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from cluster.errors import InvalidArgument
from cluster.kv_transfer.collective.kv_channel import KVChannel

log = logging.getLogger("ray.serve." + __name__)
K = TypeVar("K", bound=Hashable)


class KVChannelCache(Generic[K]):
    def __init__(
        self,
        idle_seconds: float,
        on_evict: Callable[[K, KVChannel], Awaitable[None]] | None = None,
    ) -> None:
        if idle_seconds <= 0:
            raise InvalidArgument(f"idle_seconds must be positive, got {idle_seconds}")
        self.idle_seconds = idle_seconds
        self.on_evict = on_evict
        self.evicted = 0
        self._channels: dict[K, KVChannel] = {}
        self._task: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._channels)

    def get(self, key: K) -> KVChannel | None:
        channel = self._channels.get(key)
        if channel is not None and channel.closed:
            del self._channels[key]
            return None
        return channel

    def add(self, key: K, channel: KVChannel) -> None:
        old = self._channels.get(key)
        if old is not None and old is not channel:
            old.close()
        self._channels[key] = channel

    def drop(self, key: K, channel: KVChannel | None = None) -> bool:
        """Close `channel` (default: the one under `key`) and remove it from the cache if it
        is still the one under `key`. True if an entry was removed."""
        current = self._channels.get(key)
        if channel is not None:
            channel.close()
        if current is None or (channel is not None and current is not channel):
            return False
        del self._channels[key]
        current.close()
        return True

    async def evict_idle(self) -> int:
        """Close every channel idle for `idle_seconds` with no transfer; returns how many."""
        deadline = time.monotonic() - self.idle_seconds
        idle = [
            (key, ch)
            for key, ch in self._channels.items()
            if ch.closed or (ch.busy == 0 and ch.last_used <= deadline)
        ]
        for key, channel in idle:
            del self._channels[key]
            was_open = not channel.closed
            channel.close()
            if was_open:
                self.evicted += 1
                if self.on_evict is not None:
                    await self.on_evict(key, channel)
        return len(idle)

    def start(self) -> None:
        """Run `evict_idle` in the background on the running loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop evicting and close every channel."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            channel.close()

    async def _run(self) -> None:
        interval = min(self.idle_seconds / 2, 5.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.evict_idle()
            except Exception:  # keep evicting for the channels still to come
                log.exception("KV channel eviction failed")
