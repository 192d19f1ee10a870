"""What every engine replica shares: identity, torch threads, its engine thread, health, the
stats it reports (for `GetStats`, the metrics, the autoscaler and its stats line in the log), and
a clean shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sys
import threading
import time
import uuid
from dataclasses import fields, replace

import torch

from cluster.config import EngineConfig, resolve_host
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import EngineStats
from cluster.engine.tp_launch import BundleRanks
from cluster.engine.tp_replica import TPReplica
from cluster.kv_transfer.transport_factory import make_rank_service
from cluster.serving.app_config import AppConfig
from cluster.serving.cpu_affinity import engine_cores, format_cpu_list, thread_cpus
from cluster.serving.loading_report import LoadingReport
from cluster.serving.metered_engine import EngineTotals, MeteredEngine
from cluster.serving.metrics import PoolMetrics
from cluster.serving.pool_load import LoadSignals
from cluster.serving.pool_messages import RankPlace, ReplicaStats
from cluster.serving.replica_device import on_replica
from cluster.serving.stats_line import StatsLine
from cluster.serving.stats_registry import REPORT_INTERVAL_S, registry
from cluster.serving.vllm_metrics import served_model_name

log = logging.getLogger("ray.serve." + __name__)
# The engine's figures are sampled every SAMPLE_INTERVAL_S and pushed to the stats registry as
# soon as they change, so `GetStats`, `pdserve status` and the autoscaling signals lag the
# engine by at most about one sample (plus the engine step that sample waits for). Unchanged
# figures are pushed again every REPORT_INTERVAL_S, so no registry entry is older than that.
SAMPLE_INTERVAL_S = 0.2
# A replica whose engine failed exits this long after the failure is seen, with this status.
FAILED_EXIT_DELAY_S = 0.05
EXIT_ENGINE_FAILED = 70
# The engine's figures a `ReplicaStats` carries: each one both hold, so a figure added to both
# reaches the registry (and `pool_load.LoadSignals.of`) with no change here.
_ENGINE_FIGURES = tuple(
    f.name for f in fields(EngineStats) if f.name in {g.name for g in fields(ReplicaStats)}
)


def replica_id() -> str:
    """Serve's replica id when running inside Serve, else a process-unique id."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:
        return f"local-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class EngineReplica:
    """Base of the prefill, decode and colocated deployments. Subclasses call `_start` from
    their constructor and `_shutdown` from `__del__`."""

    pool: str

    def _start(self, config: AppConfig, pool: str) -> None:
        self.pool = pool
        pool_config = config.pool(pool)
        if pool_config.torch_threads > 0:
            torch.set_num_threads(pool_config.torch_threads)
        sys.setswitchinterval(pool_config.gil_switch_interval_s)
        self.config = config
        self.replica_id = replica_id()
        self.registry = registry(config.name)
        # Device and dtype "auto" are decided here, on the node this replica runs on.
        engine_config = on_replica(config.engine_config(pool))
        self.device, self.dtype = engine_config.model.device, engine_config.model.dtype
        self.tensor_parallel_size = k = pool_config.tensor_parallel_size
        log.info("%s engine on %s in %s, tensor parallel size %d", pool, self.device, self.dtype, k)
        # Made and started on the engine cores: the engine thread and torch's threads inherit
        # them (a TP replica's follower processes too); this (event loop) thread gets its own
        # mask back, and starts the output thread. Listed as loading meanwhile (a hub model's
        # download, the weights' load).
        self.tp: TPReplica | None = None
        # A disaggregated TP replica's secret with its ranks' KV servers (`_rank_service`).
        self.replica_secret = b""
        try:
            with (
                LoadingReport(self.registry, pool, self.replica_id, tensor_parallel_size=k),
                engine_cores(pool_config.engine_cpus) as cores,
            ):
                engine = self._build_engine(engine_config)
                separate = pool_config.output_thread_on(str(engine.device))
                self.engine = AsyncEngine(engine, output_thread=separate)
                if _in_actor():
                    self.engine.on_fault = self._exit_failed
                self.engine.start_engine_thread()
            self.engine.start()
        except BaseException:
            if self.tp is not None:  # no follower outlives a replica that failed to start
                self.tp.close()
            raise
        if cores:
            log.info("%s engine thread pinned to cores %s", pool, format_cpu_list(cores))
        self.layout = self.engine.layout
        self.ranks = rank_places(self.tp)
        transport = "" if config.mode == "colocated" else config.transfer.transport
        self.metrics = PoolMetrics(pool, served_model_name(config.model), transport)
        self.stats_line = StatsLine(pool, EngineTotals(time.monotonic()))
        self.last_stats: ReplicaStats | None = None  # the latest sample
        self._pushed: ReplicaStats | None = None  # the latest pushed to the registry
        self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    def _build_engine(self, config: EngineConfig) -> MeteredEngine:
        """The replica's engine: in this process at TP 1; at TP k > 1 rank 0's, its other ranks
        as Ray actors in the bundles of its placement group (`BundleRanks`; local processes
        where it has none: outside Serve), closed by `_shutdown` (`TPReplica`)."""
        k = self.tensor_parallel_size
        if k == 1:
            return MeteredEngine(config)
        self.tp = TPReplica(
            config,
            k,
            engine_class=MeteredEngine,
            rank_service=self._rank_service(),
            launcher=BundleRanks.of_current_group(k),
        )
        assert isinstance(self.tp.engine, MeteredEngine)
        return self.tp.engine

    def _rank_service(self):
        """In a disaggregated app, what the other ranks serve their KV heads with (their own
        KV servers, on this node's address: `cluster.kv_transfer.rank_server`)."""
        if self.config.mode != "disaggregated":
            return None
        transfer = self.config.transfer
        self.replica_secret = secrets.token_bytes(32)
        return make_rank_service(transfer, resolve_host(transfer.host), self.replica_secret)

    async def stats(self) -> ReplicaStats:
        # prompt_tokens: `MeteredEngine`'s count (0 from an engine that does not meter)
        s, prompt_tokens = await self.engine.call(
            lambda e: (e.stats(), getattr(e, "prompt_tokens", 0))
        )
        figures = {n: getattr(s, n) for n in _ENGINE_FIGURES}
        return ReplicaStats(
            self.pool, self.replica_id, **figures, updated_at=time.time(),
            device=self.device, dtype=self.dtype,
            tensor_parallel_size=self.tensor_parallel_size, prompt_tokens=prompt_tokens,
            ranks=self.ranks,
        )  # fmt: skip

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling hook: this replica's load signals (see autoscaling.py).
        Answers from the last report, so a long engine step never delays it."""
        s = self.last_stats
        return {} if s is None else LoadSignals.of(s).as_dict()

    async def cpu_affinity(self) -> dict[str, list[int]]:
        """The cores the engine thread, its output thread and this replica's other threads may
        run on: an operator's check, through a Serve handle, of where `PoolConfig.engine_cpus`
        put them."""
        output = self.engine.output_native_id  # 0: the pool runs without an output thread
        return {
            "engine": list(thread_cpus(self.engine.native_id)),
            "output": list(thread_cpus(output)) if output else [],
            "replica": list(thread_cpus(threading.get_native_id())),
        }

    async def check_health(self) -> None:
        """Serve's health probe: the engine must not have failed, and its engine thread and
        output thread (if any) must be alive; else Serve replaces this replica."""
        if not self.engine.alive():
            raise RuntimeError(f"engine unhealthy: {self.engine.fault or 'a thread stopped'!r}")

    async def _report_loop(self) -> None:
        while True:
            began = time.monotonic()
            try:
                await self._report()
                if self.stats_line.due(began):
                    await self._log_stats()
            except Exception:  # reporting must never take the replica down
                log.exception("stats report failed")
            await asyncio.sleep(max(0.0, began + SAMPLE_INTERVAL_S - time.monotonic()))

    def _exit_failed(self, fault: BaseException) -> None:
        """Engine thread, once the engine failed (a forward pass raised; at TP > 1, also a rank
        that died) and its streams were failed: end this replica's process now rather than at
        the next health check. Routers then find it dead on their next call and drop it (as
        for any replica that died), instead of retrying requests into an engine that refuses
        them; the streams it was serving migrate as from a killed replica; Serve starts its
        replacement sooner."""
        log.error("engine failed (%r): this replica exits; Serve replaces it", fault)
        time.sleep(FAILED_EXIT_DELAY_S)  # the output thread may still send the streams' ends
        if self.tp is not None:
            self.tp.kill()
        os._exit(EXIT_ENGINE_FAILED)

    async def _log_stats(self) -> None:
        """Write the stats line (stats_line.py) of the interval that just ended, if it is one
        to write."""
        totals = await self.engine.call(lambda e: e.totals())
        if self.last_stats is not None:
            line = self.stats_line.next(totals, self.last_stats)
            if line is not None:
                log.info(line)

    async def _report(self) -> None:
        """Sample the engine's figures; publish them (registry and gauges) when they differ
        from the last published, or when that is nearly REPORT_INTERVAL_S old."""
        s = await self.stats()
        self.last_stats = s
        last = self._pushed
        if (
            last is not None
            and replace(last, updated_at=s.updated_at) == s
            and s.updated_at - last.updated_at < REPORT_INTERVAL_S - SAMPLE_INTERVAL_S
        ):
            return
        self.metrics.set("pdserve_replica_up", 1.0)
        self.metrics.set("pdserve_waiting_sequences", s.waiting)
        for gauge, value in LoadSignals.of(s).gauges().items():
            self.metrics.set(gauge, value)
        await self.registry.put.remote(s)
        self._pushed = s

    async def _shutdown(self) -> None:
        """Abort what is still running (streams end with finish reason "abort"), then stop: the
        engine thread, then a TP replica's follower processes."""
        self._reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reporter
        await self.engine.call(lambda e: [e.abort(rid) for rid in list(e.seqs)])
        await asyncio.sleep(0.1)  # let the abort outputs reach their streams
        with contextlib.suppress(Exception):
            await self.registry.remove.remote(self.pool, self.replica_id)
        await self.engine.stop()
        if self.tp is not None:
            await asyncio.to_thread(self.tp.close)
        self.metrics.flush()  # the values batched on the loop


def rank_places(tp: TPReplica | None) -> tuple[RankPlace, ...]:
    """Where a replica's ranks run: this process (rank 0) and, at TP > 1, each follower `tp`
    started (a Ray actor in its bundle, which says its node; a local process: this node); the
    node as Ray knows it (empty outside Ray)."""
    node_id = node_ip = ""
    if _in_actor():
        import ray

        node_id, node_ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    places = [RankPlace(0, node_id, node_ip, os.getpid())]
    for rank, p in enumerate([] if tp is None else tp.followers, start=1):
        places.append(RankPlace(rank, p.node_id or node_id, p.node_ip or node_ip, p.pid))
    return tuple(places)


def _in_actor() -> bool:
    """Whether this process is a Ray actor's (a served replica), not a test's or a driver's."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
