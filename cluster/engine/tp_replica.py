"""A tensor-parallel replica: an `Engine` on rank 0, in this process, and one follower per
other rank running `follow_steps`, joined by a `TorchGroup` (gloo on the CPU, NCCL on GPUs)
through a TCPStore rendezvous on `host`.

Start: rank 0 hosts the store on a free port and starts the followers; each follower imports,
says it is ready in the store, then every rank joins the process group (so the group's
connection timeout covers the connection, not a child's imports). Every rank loads only its
shard of the checkpoint; rank 0 chooses the KV pool's size and tells the followers.

Where the followers run is the launcher's (`cluster.engine.tp_launch`): local spawn processes
by default; served, Ray actors, rank `r` in bundle `r` of the replica's placement group (one
bundle per rank, `cluster.serving.pool_config.PoolConfig.serve_placement`), the store on the
node's address.

`close` stops the followers (one message, then a join with a deadline, then terminate) and
frees the group. A follower that dies makes rank 0's next step raise.
"""

from __future__ import annotations

import logging
import time

import torch

from cluster.config import EngineConfig
from cluster.engine.cuda_graphs import capture_decode_graphs
from cluster.engine.engine import Engine, kv_layout
from cluster.engine.kv_cache import KVCache
from cluster.engine.model_runner import ModelRunner
from cluster.engine.tp_launch import LocalRanks, local_device
from cluster.engine.tp_runner import TPModelRunner, follow_steps
from cluster.errors import InvalidArgument, Unavailable
from cluster.model.info import describe_model
from cluster.model.loader import load_model
from cluster.model.parallel.group import TorchGroup, host_store, join_store
from cluster.model.parallel.shard import TPShard
from cluster.model.triton_attention import TritonAttention

log = logging.getLogger("ray.serve." + __name__)

_LEADER_KEY = "kv/leader"


class TPReplica:
    def __init__(
        self,
        config: EngineConfig,
        tensor_parallel_size: int,
        host: str | None = None,
        timeout_s: float = 60.0,
        start_timeout_s: float = 300.0,
        engine_class: type[Engine] = Engine,
        rank_service=None,
        launcher=None,
        graph_capture=None,
    ) -> None:
        """`engine_class`: rank 0's engine, `Engine` or a subclass that keeps its constructor
        (a served replica's `MeteredEngine`). `rank_service`: what each other rank serves its
        KV with (picklable, with `start(pool, leader) -> "host:port"`, e.g.
        `cluster.kv_transfer.rank_server.RankService`); their endpoints are `rank_endpoints`,
        and rank 0's own KV server is told to them with `publish_leader`. `launcher`: where
        the other ranks run (`cluster.engine.tp_launch`: local processes by default, or Ray
        actors in the replica's placement-group bundles); `host` (default the launcher's):
        the address of the rendezvous store, which every rank must reach. `graph_capture`:
        how every rank captures its decode graphs (`capture_graphs`)."""
        k = tensor_parallel_size
        if k < 2:
            raise InvalidArgument("a TPReplica has 2 or more ranks; use Engine for TP 1")
        config = config.resolved()
        TPShard.of(describe_model(config.model).spec, 0, k)  # refuses a size that does not split
        self.timeout_s = timeout_s
        launcher = launcher or LocalRanks()
        host = host or launcher.host
        store = host_store(host, k, start_timeout_s)
        threads = torch.get_num_threads()
        args = (config, k, host, store.port, timeout_s, threads, rank_service, graph_capture)
        self.followers: list = []
        try:
            for rank in range(1, k):
                gpu = launcher.gpu_index(rank)
                self.followers.append(launcher.start(_follower, rank, (*args, gpu)))
            _wait_ready(store, self.followers, start_timeout_s)
            device = torch.device(config.model.device)
            self.group = TorchGroup(0, k, store, device, timeout_s)
            loaded = load_model(config.model, self.group)
            # Every rank has its shard (loading is not a collective: a slow follower may still
            # be reading): wait for them with the start's deadline, not a step's.
            self.group.broadcast_object("loaded", timeout_s=start_timeout_s)
            self.engine = engine_class(config, loaded)
            self.rank_endpoints: tuple[str, ...] = ()
            if rank_service is not None:
                keys = [f"kv/{rank}" for rank in range(1, k)]
                _wait_keys(store, keys, self.followers, start_timeout_s)
                self.rank_endpoints = tuple(store.get(key).decode() for key in keys)
            engine = self.engine
            capture_graphs(engine.runner, config, engine.max_model_len, graph_capture)
        except BaseException:
            self._reap(0.0)
            raise
        self.store = store  # kept alive: the followers' group was made through it
        self.tallies: dict[int, tuple[int, int]] = {}  # set by `close`

    def publish_leader(self, endpoint: str) -> None:
        """Tell the other ranks' KV servers rank 0's ("host:port"), which owns the leases."""
        self.store.set(_LEADER_KEY, endpoint)

    def close(self) -> None:
        """Stop the followers; the engine is unusable afterwards. Idempotent."""
        if any(p.is_alive() for p in self.followers):
            runner = self.engine.runner
            assert isinstance(runner, TPModelRunner)
            try:
                runner.stop_followers()
            except Exception:
                log.warning("could not tell the TP followers to stop", exc_info=True)
        self._reap(self.timeout_s)
        self.tallies = self._tallies()
        if self.tallies:
            log.info("TP followers stopped: (steps, graph replays) per rank %s", self.tallies)

    def _tallies(self) -> dict[int, tuple[int, int]]:
        """Each follower that stopped when told: the steps it ran and how many replayed."""
        out = {}
        for rank in range(1, len(self.followers) + 1):
            key = f"tally/{rank}"
            if self.store.check([key]):
                steps, replayed = self.store.get(key).decode().split()
                out[rank] = (int(steps), int(replayed))
        return out

    def kill(self) -> None:
        """Terminate the followers at once (the group is broken: no stop message)."""
        self._reap(0.0)

    def _reap(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.followers:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()

    def __enter__(self) -> TPReplica:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wait_ready(store, followers: list, timeout_s: float) -> None:
    _wait_keys(
        store, [f"ready/{rank}" for rank in range(1, len(followers) + 1)], followers, timeout_s
    )


def _wait_keys(store, keys: list[str], followers: list, timeout_s: float) -> None:
    """Wait until the followers have set every key of `keys` in the store (rank order)."""
    deadline = time.monotonic() + timeout_s
    for rank, key in enumerate(keys, start=1):
        while True:
            if store.check([key]):
                break
            dead = [p.pid for p in followers if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                why = f"exited (pids {dead})" if dead else f"did not set {key} in {timeout_s} s"
                raise Unavailable(f"TP follower rank {rank} {why}")
            time.sleep(0.05)


def _follower(
    rank: int,
    config: EngineConfig,
    world_size: int,
    host: str,
    port: int,
    timeout_s: float,
    threads: int,
    rank_service=None,
    graph_capture=None,
    gpu_index: int = 0,
) -> None:
    """A follower (a process or a Ray actor's call): join the group, load this rank's shard,
    build its KV pool with the leader's block count, then run steps until told to stop."""
    torch.set_num_threads(threads)
    store = join_store(host, port, world_size, timeout_s)
    device = local_device(torch.device(config.model.device), gpu_index)
    store.set(f"ready/{rank}", "1")
    group = TorchGroup(rank, world_size, store, device, timeout_s)
    loaded = load_model(config.model, group)
    model = loaded.model
    group.broadcast_object(timeout_s=None)  # every rank has loaded its shard
    num_blocks = group.broadcast_object()  # rank 0 sizes the pool
    layout = kv_layout(loaded.info.model_id, model, config)
    kv = KVCache(layout, num_blocks, config.model.torch_dtype, device)
    if rank_service is not None:
        # Its own store client: the service's thread asks for rank 0's endpoint when it needs it.
        leader_store = join_store(host, port, world_size, timeout_s)
        store.set(f"kv/{rank}", rank_service.start(kv, lambda: _leader(leader_store)))
    runner = ModelRunner(model, kv, device)
    capture_graphs(runner, config, loaded.info.max_model_len, graph_capture)  # with rank 0
    steps, replayed = follow_steps(runner, group)
    store.set(f"tally/{rank}", f"{steps} {replayed}")  # told to stop: what it ran, for close


def capture_graphs(runner: ModelRunner, config: EngineConfig, max_model_len: int, capture=None):
    """A rank's decode graphs (`cluster.engine.cuda_graphs`). Every rank captures the same
    buckets in the same order at the same point of its start, since each capture's warm-up
    step runs the model's collectives; NCCL's are captured into the graphs. CUDA graphs where a
    TP 1 engine would capture them (`model.cuda_graphs`, a GPU on the Triton path); with
    `capture` given (`cuda_graphs.replay_by_calling`, the CPU's stand-in) on the Triton path
    whatever the device, as the TP 1 graph tests run it."""
    if capture is not None and runner.varlen_attention is None:
        runner.varlen_attention = TritonAttention(runner.sliding_window)
    if not config.model.cuda_graphs or runner.varlen_attention is None:
        return
    runner.graphs = capture_decode_graphs(
        runner.model,
        runner.kv_cache,
        runner.varlen_attention,
        config.scheduler.max_num_seqs,
        max_model_len,
        runner.device,
        capture=capture,
    )


def _leader(store) -> str:
    """Rank 0's KV server, once `publish_leader` has set it (waits for it)."""
    store.wait([_LEADER_KEY])
    return store.get(_LEADER_KEY).decode()
