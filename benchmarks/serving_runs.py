"""The serving benchmark's measurements: section 1's interleaved decode runs (in-process,
served, and each decoding replica's engine alone), section 2's KV fetches and section 3's
time-to-first-token runs."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from benchmarks.engine_timing import per_token, timed_decode
from benchmarks.grpc_calls import Stream, served_generate, wait_ready
from benchmarks.proc_stats import ThreadTimes, cpu_seconds, set_thread_niceness, thread_niceness
from benchmarks.report import log
from benchmarks.serving_config import APP, DECODING, MODES, TTFT_TOKENS, ServingBenchConfig
from benchmarks.serving_results import Results
from cluster.engine.engine import Engine
from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from cluster.serving.app_config import AppConfig

T = TypeVar("T")


class Baseline:
    """The in-process reference: an engine of the replicas' config on a thread of its own,
    with the decode replica's priority (`nice`) and, given `cpus`, the engine cores. The engine
    is made on that thread, as the replicas make theirs on the engine cores."""

    def __init__(self, app: AppConfig, nice: int | None, cpus: tuple[int, ...]) -> None:
        self.pool = ThreadPoolExecutor(1, initializer=_baseline_thread, initargs=(nice, cpus))
        self.niceness = self.pool.submit(thread_niceness).result()
        self.engine: Engine = self.pool.submit(Engine, app.engine_config("colocated")).result()

    def time_decode(self, prompt: list[int], n: int) -> tuple[float, float]:
        return self.pool.submit(timed_decode, self.engine, prompt, n).result()

    def close(self) -> None:
        del self.engine
        self.pool.shutdown()


def _baseline_thread(nice: int | None, cpus: tuple[int, ...]) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    set_thread_niceness(nice)


def make_prompt(cfg: ServingBenchConfig, engine: Engine, n: int, salt: int = 0) -> list[int]:
    rng = random.Random(cfg.seed * 1000003 + salt)
    # Skip the low ids, where make_model's tokenizers keep their special tokens.
    return [rng.randrange(16, engine.info.spec.vocab_size) for _ in range(n)]


def engine_thread_split(s: Stream, n: int) -> tuple[float, float, float] | None:
    """(on CPU, waiting for a CPU, off CPU otherwise) seconds per token of the decoding
    engine thread between the arrivals of tokens 2 and N; the three add up to the client's
    mean interval."""
    if s.marks is None or s.marks[0] is None or s.marks[1] is None:
        return None
    a, b = s.marks
    wall = (s.token_times[-1] - s.token_times[1]) / (n - 2)
    on_cpu = (b.on_cpu_s - a.on_cpu_s) / (n - 2)
    waiting = (b.runqueue_s - a.runqueue_s) / (n - 2)
    return on_cpu, waiting, wall - on_cpu - waiting


def _decoding_replica(mode: str):
    """The Serve handle of `mode`'s decoding deployment (one replica in this benchmark)."""
    from ray import serve

    return serve.get_deployment_handle(DECODING[mode], app_name=MODES[mode])


def _engine_clock(replica, pid: int | None) -> Callable[[], ThreadTimes | None] | None:
    """Reads of the scheduler accounting of the engine thread of `replica` (a decoding
    deployment's handle) in process `pid`, or None where that process is not known here (a Ray
    this process did not start)."""
    if pid is None:
        return None
    tid = replica.engine_thread_id.remote().result()
    return lambda: ThreadTimes.read(pid, tid)


class DecodeRuns:
    """Section 1's interleaved decode runs: in-process, then each app, `cfg.repeats` times."""

    def __init__(self, cfg: ServingBenchConfig, res: Results, baseline: Baseline, stub) -> None:
        self.cfg, self.res, self.baseline, self.stub = cfg, res, baseline, stub
        self.prompt = make_prompt(cfg, baseline.engine, cfg.short_prompt)

    def measure(self, modes: list[str], procs: dict[str, int]) -> None:
        """`cfg.repeats` rounds over the in-process engine and `modes`' apps (`procs`: the
        serving processes of our Ray), the order rotated every round."""
        cfg, res, n = self.cfg, self.res, self.cfg.decode_tokens
        for m in modes:
            wait_ready(self.stub, MODES[m], self.prompt)
        # Warm-up: one full run of each, so no first-call cost lands in the numbers.
        self.baseline.time_decode(self.prompt, n)
        for m in modes:
            served_generate(self.stub, MODES[m], self.prompt, n)
            res.start_mode(m)
        self.replicas = {m: _decoding_replica(m) for m in modes}
        self.clocks = {
            m: _engine_clock(self.replicas[m], procs.get(f"{m}/{DECODING[m]}")) for m in modes
        }
        self.pids = {
            m: {k: pid for k, pid in procs.items() if k == "proxy" or k.startswith(m)}
            for m in modes
        }
        for r in range(cfg.repeats):
            # Rotate the order (in-process first, then second, ...) so that no app always runs
            # right after the in-process engine, or right after another app.
            order = [None, *modes]
            order = order[r % len(order) :] + order[: r % len(order)]
            for m in order:
                if m is None:
                    wall, cpu = self.baseline.time_decode(self.prompt, n)
                    res.inproc_s.append(wall)
                    res.inproc_cpu_s.append(cpu)
                else:
                    self._served_pair(m, alone_first=bool(r % 2))
            log(
                f"decode run {r + 1}/{cfg.repeats}: in-process {res.inproc_s[-1] * 1e3:.2f} ms/tok"
                + "".join(f", {m} {res.served_s[m][-1] * 1e3:.2f}" for m in modes)
            )

    def _served_pair(self, m: str, alone_first: bool) -> None:
        """One served run of mode `m` and, before or after it, its replica's engine alone."""
        res, n = self.res, self.cfg.decode_tokens
        if alone_first:
            self._time_alone(m)
        total_a, step_a = self.replicas[m].engine_cpu.remote().result()
        s, cpu_per_token = self._with_cpu(
            m, served_generate, self.stub, MODES[m], self.prompt, n, self.clocks[m]
        )
        total_b, step_b = self.replicas[m].engine_cpu.remote().result()
        res.loop_cpu_s[m].append(((total_b - total_a) - (step_b - step_a)) / (n - 1))
        res.served_s[m].append(per_token(s.token_times))
        if (split := engine_thread_split(s, n)) is not None:
            res.engine_thread_s[m].append(split)
        for k, v in cpu_per_token.items():
            res.served_cpu_s[m].setdefault(k, []).append(v)
        if not alone_first:
            self._time_alone(m)
        if m == "disaggregated":
            t = s.last.timing
            res.incl_transfer_s.append((t.total_seconds - t.time_to_first_token_seconds) / (n - 1))

    def _with_cpu(self, m: str, fn: Callable[..., T], *args) -> tuple[T, dict[str, float]]:
        """`fn(*args)`, and the CPU seconds per output token each of `m`'s processes (and this
        one) spent meanwhile."""
        n = self.cfg.decode_tokens
        before, client_before = cpu_seconds(self.pids[m]), time.process_time()
        result = fn(*args)
        after, client_after = cpu_seconds(self.pids[m]), time.process_time()
        cpu = {k: (after[k] - before[k]) / n for k in before if k in after}
        cpu["client (this process)"] = (client_after - client_before) / n
        return result, cpu

    def _time_alone(self, m: str) -> None:
        """Its replica's engine alone, in its own process: per token, wall and CPU."""
        res = self.res
        alone = self.replicas[m].time_decode.remote
        (wall, cpu), procs_cpu = self._with_cpu(
            m, lambda: alone(self.prompt, self.cfg.decode_tokens).result()
        )
        res.alone_s[m].append(wall)
        res.alone_cpu_s[m].append(cpu)
        for k, v in procs_cpu.items():
            res.alone_proc_cpu_s[m].setdefault(k, []).append(v)


def kv_fetches(
    cfg: ServingBenchConfig, app: AppConfig, engine: Engine
) -> dict[int, list[tuple[int, float]]]:
    """Section 2: per long prompt, [(bytes, seconds)] of the timed fetches of its KV."""
    from ray import serve

    prefill = serve.get_deployment_handle("Prefill", app_name=APP)
    out = {}
    loop = asyncio.new_event_loop()
    try:
        for n_tok in cfg.long_prompts:
            out[n_tok] = loop.run_until_complete(timed_fetches(prefill, cfg, app, engine, n_tok))
            b, s = out[n_tok][-1]
            log(f"KV fetch {n_tok} tokens: {b / 1e6:.1f} MB in {s * 1e3:.1f} ms")
    finally:
        loop.close()
    return out


async def timed_fetches(
    prefill, cfg: ServingBenchConfig, app: AppConfig, engine: Engine, n_tok: int
) -> list[tuple[int, float]]:
    """Prefill one prompt on the real replica, fetch its held KV `1 + cfg.fetches` times (the
    first is a warm-up), release it. Returns [(bytes, seconds)] of the timed fetches."""
    prompt = make_prompt(cfg, engine, n_tok, salt=n_tok)
    fits = min(cfg.decode_tokens, engine.max_model_len - n_tok)  # >= 2: the KV stays held
    params = SamplingParams(max_tokens=fits, temperature=0.0, ignore_eos=True)
    result = await prefill.prefill.remote(Request(uuid.uuid4().hex, tuple(prompt), params))
    handle = result.handle
    assert handle is not None, f"a {n_tok}-token prompt finished in prefill: no KV to fetch"
    client = GrpcKVClient(
        app.transfer.max_chunk_bytes,
        app.transfer.fetch_timeout_seconds,
        max_blocks=app.decode.cache.num_blocks,
    )
    out = []
    try:
        for i in range(1 + cfg.fetches):
            t = time.perf_counter()
            kv = await client.fetch(handle, engine.layout)
            seconds = time.perf_counter() - t
            if i:
                out.append((kv.k.nbytes + kv.v.nbytes, seconds))
            del kv
    finally:
        await client.release(handle, "fetched")
        await client.close()
    return out


def ttft_runs(cfg: ServingBenchConfig, stub, engine: Engine) -> dict[int, list[dict[str, float]]]:
    """Section 3: per long prompt, the timings of `cfg.ttft_runs` disaggregated runs of
    `TTFT_TOKENS` tokens after a warm-up, each with a prompt of its own (a repeated one would
    be served from the prefix cache)."""
    out: dict[int, list[dict[str, float]]] = {}
    for n_tok in cfg.long_prompts:
        prompts = [
            make_prompt(cfg, engine, n_tok, salt=7 * n_tok + 1000 * r)
            for r in range(cfg.ttft_runs + 1)
        ]
        served_generate(stub, APP, prompts[0], TTFT_TOKENS)  # warm-up at this length
        out[n_tok] = []
        for prompt in prompts[1:]:
            s = served_generate(stub, APP, prompt, TTFT_TOKENS)
            t = s.last.timing
            out[n_tok].append(
                {
                    "client_ttft": s.token_times[0] - s.call_at,
                    "ttft": t.time_to_first_token_seconds,
                    "prefill": t.prefill_seconds,
                    "transfer": t.kv_transfer_seconds,
                    "gap2": s.token_times[1] - s.token_times[0],
                }
            )
        x = out[n_tok][-1]
        log(f"TTFT {n_tok} tokens: {x['ttft'] * 1e3:.0f} ms, transfer {x['transfer'] * 1e3:.1f} ms")
    return out
