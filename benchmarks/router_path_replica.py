"""`router_path_bench --in-serve`: the router's path behind its direct endpoint in a Serve
replica, as Serve runs pdserve's router (the same replica environment, the router's metrics
recorded), fed by the bench's worker double; the replica stands in for a server process."""

from __future__ import annotations

import os

from ray import serve

from benchmarks.router_path_servers import router_path, serve_router_path

APP = "router-path"


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class RouterPathReplica:
    async def __init__(self, worker_port: int, checkpoint: str) -> None:
        from cluster.config import ModelConfig
        from cluster.serving.metrics import PoolMetrics
        from cluster.serving.vllm_metrics import served_model_name

        metrics = PoolMetrics("router", served_model_name(ModelConfig(path=checkpoint)))
        self.orch = await router_path(worker_port, checkpoint, metrics)
        self.server = await serve_router_path(self.orch)

    def where(self) -> tuple[str, int]:
        """(its endpoint, its process id)."""
        return self.server.endpoint, os.getpid()


class ServedRouterPath:
    """The replica deployed on the running Serve, as `measure` uses a server process: `pid`,
    `kill` (deletes the app), `join`."""

    def __init__(self, worker_port: int, checkpoint: str) -> None:
        from cluster.serving.app import REPLICA_ENV_VARS

        env = {"runtime_env": {"env_vars": dict(REPLICA_ENV_VARS)}, "num_cpus": 0}
        app = RouterPathReplica.options(ray_actor_options=env).bind(worker_port, checkpoint)
        try:
            handle = serve.run(app, name=APP, route_prefix=None)
            self.endpoint, self.pid = handle.where.remote().result()
        except BaseException:
            self.kill()  # nothing of it left on the running Serve
            raise

    def kill(self) -> None:
        serve.delete(APP)

    def join(self) -> None:
        pass
