"""Engine replicas with timing probes, deployed by the serving benchmark in place of the
production role classes (`cluster.serving.app.compose_app(config, PROBED_ROLES)`).

The probes read what only the replica's process can: its engine timed alone on its own engine
thread, that thread's OS id (for /proc/PID/task/TID readings on the node) and its CPU time
inside and outside `Engine.step`. Production replicas do not carry them.
"""

from __future__ import annotations

from benchmarks.engine_timing import timed_decode
from cluster.engine.engine import Engine
from cluster.errors import InvalidArgument, Unavailable
from decode_worker.colocated_worker import ColocatedWorker
from decode_worker.decode_worker import DecodeWorker

MAX_TIMED_TOKENS = 4096


class EngineProbes:
    """Mixed into an `EngineReplica` subclass (it needs the replica's `engine`)."""

    async def time_decode(self, prompt_token_ids: list[int], max_tokens: int) -> list[float]:
        """This replica's engine alone: one batch-1 greedy generation (ignore_eos) stepped in
        a plain loop on the engine thread, with no Serve, token stream or gRPC on its path;
        [seconds, engine-thread CPU seconds] per output token over tokens 2..N. The serving
        benchmark's reference (same weights in the same memory as the served runs). Other
        requests wait while it runs, so a replica with work refuses it (UNAVAILABLE)."""
        if not 3 <= max_tokens <= MAX_TIMED_TOKENS:
            raise InvalidArgument(f"max_tokens must be in 3..{MAX_TIMED_TOKENS}")

        def run(engine: Engine) -> list[float]:
            if engine.has_work():
                raise Unavailable("the engine has requests; time_decode needs an idle replica")
            return list(timed_decode(engine, list(prompt_token_ids), max_tokens))

        return await self.engine.call(run)  # type: ignore[attr-defined]

    async def engine_thread_id(self) -> int:
        """The engine thread's OS thread id, for readings of /proc/PID/task/TID on this node
        (the serving benchmark's scheduler accounting of served runs)."""
        return self.engine.native_id  # type: ignore[attr-defined]

    async def engine_cpu(self) -> list[float]:
        """[all, inside `Engine.step`] CPU seconds of the engine thread since it started."""
        return list(self.engine.cpu_seconds())  # type: ignore[attr-defined]


class ProbedDecodeWorker(EngineProbes, DecodeWorker):
    pass


class ProbedColocatedWorker(EngineProbes, ColocatedWorker):
    pass


# The roles whose engines the serving benchmark times (`compose_app`'s `role_classes`).
PROBED_ROLES = {
    "Decode": "benchmarks.probed_replicas:ProbedDecodeWorker",
    "Colocated": "benchmarks.probed_replicas:ProbedColocatedWorker",
}
