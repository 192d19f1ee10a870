"""What serving through Ray Serve costs on top of the engine, and what moving the KV costs.

    python -m benchmarks.serving_bench [--out FILE] [--quick] [--grpc-port PORT]
                                               [--engine-cpus LIST]

On one checkpoint (`small` by default, `tiny` with `--quick`), fp32 on CPU (or `--device cuda
--dtype bfloat16`: every engine replica and the baseline on GPU 0), one run prints:

1. decode time per output token of a batch-1 greedy `ignore_eos` generation with a short
   prompt: in this process (`Engine.step()` loop, same engine config, torch threads, CPU
   priority and, with `--engine-cpus`, cores as the replicas) and through the deployed app
   over Serve's gRPC proxy (client-side, from the arrival times of the streamed messages),
   disaggregated and
   colocated, with the default direct token stream, and disaggregated once more with tokens
   relayed back through the Serve handles (`token_stream: serve`, `--no-serve-relay` skips
   it). All count the steps after the second output token, so neither the prefill nor
   the KV transfer is in the number. Runs are interleaved (in-process and each app, the order
   rotated every repeat) so a change in machine load hits all alike and none always runs
   right after another. The serve-relay app is measured last, alone
   (the other apps deleted first) against in-process runs of its own, so its idle replicas add
   no load to the others' numbers and vice versa. The added latency is
   the median of the paired differences. The CPU time each process spends per output token
   (read from /proc) shows where the serving path's time goes.
2. KV transfer throughput on loopback: `GrpcKVClient.fetch` from this process of a prompt's KV
   held by the real prefill replica (via the `Prefill` deployment's handle), bytes being the
   assembled K and V tensors' `nbytes`.
3. KV transfer as a share of TTFT, from the `timing` of the final `GenerateResponse`.

With `--engine-cpus LIST` the engine threads (every replica's and the baseline's) run only on
those cores and everything else (Ray's processes, the proxies, the router, this client) only on
the others, as `pdserve serve --engine-cpus` deploys a CPU node.

Without `--grpc-port` it starts its own local Ray and Serve and shuts them down at the end;
with it, it uses the Serve already running in this process's Ray (e.g. a test session's) and
only deploys and deletes its own apps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import platform
import random
import re
import socket
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import grpc
import torch

from benchmarks.engine_bench import (
    cpu_model,
    default_model_dir,
    device_name,
    ensure_model,
)
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig, TransferConfig
from cluster.engine.engine import Engine
from cluster.engine.engine_timing import per_token, timed_decode
from cluster.kv_transfer.grpc_kv_client import GrpcKVClient
from cluster.model.make_model import FORMAT_VERSION, make_model
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from cluster.serving.app_config import AppConfig, PoolConfig
from cluster.serving.cpu_affinity import cpu_list_arg, format_cpu_list, reserve_for_engines

ADDED_LATENCY_TARGET_S = 1e-3  # per output token, served vs in-process
TRANSFER_SHARE_TARGET = 0.10  # KV transfer time / TTFT
APP, APP_COLOCATED, APP_SERVE_RELAY = "bench", "bench-co", "bench-sr"
MODES = {"disaggregated": APP, "colocated": APP_COLOCATED, "serve-relay": APP_SERVE_RELAY}
LABELS = {
    "disaggregated": "disaggregated",
    "colocated": "colocated",
    "serve-relay": "disaggregated, tokens relayed through the Serve handles",
}
TTFT_TOKENS = 2  # the prefill's token, then one decode step after the KV transfer
# Section 3's runs per prompt length: `repeats`, at most this many. The KV share varies little
# from run to run; many repeats are for section 1's paired differences, and a 2046-token run
# takes seconds on a CPU.
TTFT_RUNS_MAX = 15
# The deployment whose engine decodes in each mode (its `time_decode` is the same-engine
# reference).
DECODING = {"disaggregated": "Decode", "colocated": "Colocated", "serve-relay": "Decode"}

T = TypeVar("T")


@dataclass(frozen=True)
class BenchConfig:
    model_dir: Path
    preset: str
    decode_tokens: int  # N: output tokens of the decode-latency runs
    short_prompt: int  # prompt tokens of the decode-latency runs
    long_prompts: tuple[int, ...]  # prompt tokens of the KV transfer / TTFT runs
    repeats: int
    fetches: int  # timed fetches of each held prompt
    torch_threads: int
    replica_cpus: float
    block_size: int
    num_blocks: int
    chunk_tokens: int  # scheduler token budget per step: longer prompts are prefilled in chunks
    max_chunk_bytes: int  # KV transfer chunk size
    colocated: bool
    serve_relay: bool  # also measure the app with token_stream "serve"
    worker_niceness: int  # RAY_worker_niceness of a Ray this script starts itself
    seed: int
    device: str = "cpu"
    dtype: str = "float32"
    engine_cpus: tuple[int, ...] = ()  # engine threads here; Ray and this client elsewhere

    @property
    def ttft_runs(self) -> int:
        """Section 3's timed runs per prompt length."""
        return min(self.repeats, TTFT_RUNS_MAX)


@dataclass
class Results:
    cfg: BenchConfig
    app: AppConfig
    inproc_s: list[float] = field(default_factory=list)  # per token, one value per run
    inproc_cpu_s: list[float] = field(default_factory=list)  # CPU per token, one per run
    # the in-process runs paired with the serve-relay app's (measured after the others)
    relay_inproc_s: list[float] = field(default_factory=list)
    relay_inproc_cpu_s: list[float] = field(default_factory=list)
    served_s: dict[str, list[float]] = field(default_factory=dict)  # mode -> per token per run
    # mode -> per token per run of the mode's replica engine alone (`time_decode`), each run
    # next to a served one
    alone_s: dict[str, list[float]] = field(default_factory=dict)
    alone_cpu_s: dict[str, list[float]] = field(default_factory=dict)  # its thread CPU time
    # mode -> per served run: the decoding engine thread's (on CPU, waiting for a CPU, off CPU
    # otherwise) seconds per output token over tokens 2..N
    engine_thread_s: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    # mode -> per served run: the engine thread's CPU seconds per output token outside
    # `Engine.step` (its loop's own work: commands, the KV import, handing outputs on)
    loop_cpu_s: dict[str, list[float]] = field(default_factory=dict)
    # mode -> process -> CPU seconds per output token, one value per run
    served_cpu_s: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # the same over the run of its replica's engine alone next to it (the processes' CPU when
    # the serving path is idle: the pairs' difference is what serving costs each of them)
    alone_proc_cpu_s: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    incl_transfer_s: list[float] = field(default_factory=list)  # (total - TTFT) / (N - 1)
    fetch: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # len -> (B, s)
    ttft: dict[int, list[dict[str, float]]] = field(default_factory=dict)  # len -> timings
    niceness: dict[str, int] = field(default_factory=dict)  # process -> nice
    proxy_env: dict[str, str] | None = None  # node_env of the proxy; None: not found
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    started: str = ""
    elapsed_s: float = 0.0


# -- configuration -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, BenchConfig]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny preset, short prompts")
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown report here")
    p.add_argument(
        "--grpc-port",
        type=int,
        default=0,
        help="use the Serve already running in this process's Ray, whose gRPC proxy is on "
        "this port (default: start a local Ray and Serve, and shut them down after)",
    )
    p.add_argument("--model-dir", type=Path, default=None, help="checkpoint dir; built if absent")
    p.add_argument("--decode-tokens", type=int, default=None, help="default 64 (12 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="default 15 (2 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch threads, replicas and baseline")
    p.add_argument("--no-colocated", action="store_true", help="skip the colocated app")
    p.add_argument(
        "--no-serve-relay",
        action="store_true",
        help="skip the disaggregated app that relays tokens through the Serve handles",
    )
    p.add_argument(
        "--worker-niceness",
        type=int,
        default=0,
        help="nice value of the Ray workers when this script starts Ray (Ray's own default is "
        "15, which starves the replicas on a machine shared with other work); the in-process "
        "baseline always runs at the decode replica's nice value",
    )
    p.add_argument(
        "--engine-cpus",
        type=cpu_list_arg,
        default=(),
        metavar="LIST",
        help="cores for the engine threads (replicas and baseline), e.g. 1; the Ray this script "
        "starts, its proxies, the router and the client run on the other cores "
        "(PoolConfig.engine_cpus, as `pdserve serve --engine-cpus`)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda: engine replicas and baseline")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    a = p.parse_args(argv)
    q = a.quick
    if a.engine_cpus and a.grpc_port:
        p.error(
            "--engine-cpus needs a Ray this script starts (the running one is not kept off them)"
        )
    preset = "tiny" if q else "small"
    decode_tokens = a.decode_tokens or (12 if q else 64)
    if decode_tokens < 4:
        p.error("--decode-tokens must be >= 4")
    # The presets' max_position_embeddings is 2048 and the context includes the generated
    # tokens. A 2047-token prompt finishes on the prefill's token ("length"), so no KV ever
    # moves; 2046 tokens is the longest prompt that is handed to decode (same 128 KV blocks).
    long_prompts = (32, 126) if q else (512, 2046)
    chunk_tokens = 64 if q else 512
    need = -(-(max(long_prompts) + decode_tokens) // 16)
    cfg = BenchConfig(
        model_dir=(a.model_dir or _model_dir(preset)).expanduser().absolute(),
        preset=preset,
        decode_tokens=decode_tokens,
        short_prompt=16,
        long_prompts=long_prompts,
        repeats=a.repeats or (2 if q else 15),
        fetches=2 if q else 5,
        torch_threads=a.threads,
        replica_cpus=0.25 if q else 1.0,
        block_size=16,
        num_blocks=2 * need + 8,  # a held lease and a decoding copy of the longest prompt
        chunk_tokens=chunk_tokens,
        max_chunk_bytes=TransferConfig().max_chunk_bytes,
        colocated=not a.no_colocated,
        serve_relay=not a.no_serve_relay,
        worker_niceness=a.worker_niceness,
        seed=0,
        device=a.device,
        dtype=a.dtype,
        engine_cpus=a.engine_cpus,
    )
    return a, cfg


# On a GPU, the engine replicas of both apps (prefill, decode, colocated) share GPU 0.
GPU_SHARE = 0.3


def app_config(cfg: BenchConfig) -> AppConfig:
    on_gpu = cfg.device.startswith("cuda")
    pool = PoolConfig(
        num_cpus=cfg.replica_cpus,
        num_gpus=GPU_SHARE if on_gpu else 0.0,
        torch_threads=cfg.torch_threads,
        engine_cpus=cfg.engine_cpus,
        cache=CacheConfig(block_size=cfg.block_size, num_blocks=cfg.num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=cfg.chunk_tokens),
    )
    return AppConfig(
        model=ModelConfig(path=str(cfg.model_dir), dtype=cfg.dtype, device=cfg.device),
        router=replace(pool, num_cpus=min(cfg.replica_cpus, 0.5), num_gpus=0.0, engine_cpus=()),
        prefill=pool,
        decode=pool,
        transfer=TransferConfig(
            lease_seconds=120.0, max_chunk_bytes=cfg.max_chunk_bytes, fetch_timeout_seconds=120.0
        ),
        default_max_tokens=cfg.decode_tokens,
        name=APP,
    )


def _model_dir(preset: str) -> Path:
    root = os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve"
    return Path(root).expanduser().absolute() / "models" / f"{preset}-{FORMAT_VERSION}"


def _ensure_model(cfg: BenchConfig) -> None:
    if not (cfg.model_dir / "config.json").is_file():
        try:
            make_model(cfg.preset, cfg.model_dir, seed=0)
        except FileExistsError:  # a concurrent build won
            pass


# -- the processes of our Ray, from /proc ------------------------------------------------------

_ROLE = re.compile(r"(?:ServeReplica:|SERVE_REPLICA::)([\w-]+)[:#](\w+)")


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat fields after the command name: [0] state, [1] ppid, [11] utime,
    [12] stime, [16] nice."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2 :].split()


def serving_processes() -> dict[str, int]:
    """pid of the gRPC proxy and of each replica of our apps ("proxy", "disaggregated/Decode",
    ...), found among the workers of the raylet this process started. Empty if this process did
    not start its Ray (then no CPU accounting is reported)."""
    ppid: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid[int(entry.name)] = int(_stat(int(entry.name))[1])
            except (OSError, ValueError, IndexError):
                continue
    raylets = [p for p, pp in ppid.items() if pp == os.getpid() and _comm(p) == "raylet"]
    apps = {name: mode for mode, name in MODES.items()}
    found: dict[str, int] = {}
    for pid, parent in ppid.items():
        if parent not in raylets:
            continue
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if title.startswith("ray::ProxyActor"):
            found["proxy"] = pid
        elif (m := _ROLE.search(title)) and m.group(1) in apps:
            found[f"{apps[m.group(1)]}/{m.group(2)}"] = pid
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            f = _stat(pid)
            out[name] = (int(f[11]) + int(f[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return out


def node_env(pid: int) -> dict[str, str]:
    """The `cluster.serving.app.NODE_ENV_VARS` keys set in process `pid`'s environment
    (`RAY_SERVE_PROXY_USE_GRPC=1` in the proxy: it reaches the router over gRPC, not by Ray
    actor calls)."""
    from cluster.serving.app import NODE_ENV_VARS

    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0"))
    return {k: v for k, _, v in pairs if k in NODE_ENV_VARS}


def niceness(pid: int) -> int | None:
    try:
        return int(_stat(pid)[16])
    except (OSError, ValueError, IndexError):
        return None


# -- measurements ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThreadTimes:
    """One reading of a thread's scheduler accounting (/proc/PID/task/TID/schedstat): time on
    a CPU and time runnable but waiting for one, since the thread started."""

    on_cpu_s: float
    runqueue_s: float

    @staticmethod
    def read(pid: int, tid: int) -> ThreadTimes | None:
        try:
            on_cpu, waiting, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            return None
        return ThreadTimes(int(on_cpu) / 1e9, int(waiting) / 1e9)


@dataclass(frozen=True)
class Stream:
    call_at: float
    token_times: list[float]  # arrival time of each token (messages carry one token each)
    last: pb.GenerateResponse
    token_ids: list[int]
    # `clock`'s readings when token 2 and token N arrived
    marks: tuple[ThreadTimes | None, ThreadTimes | None] | None = None


def served_generate(
    stub, app: str, prompt: list[int], n: int, clock: Callable[[], ThreadTimes | None] | None = None
) -> Stream:
    sampling = pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
    times: list[float] = []
    ids: list[int] = []
    marks: list[ThreadTimes | None] = []
    last = None
    start = time.perf_counter()
    for msg in stub.Generate(request, metadata=(("application", app),)):
        now = time.perf_counter()
        before = len(times)
        times.extend(now for _ in msg.token_ids)
        ids.extend(msg.token_ids)
        if clock is not None and (before < 2 <= len(times) or before < n <= len(times)):
            marks.append(clock())
        last = msg
    assert last is not None and len(times) == n, f"{app}: got {len(times)} tokens, not {n}"
    return Stream(start, times, last, ids, (marks[0], marks[-1]) if clock is not None else None)


def wait_ready(stub, app: str, prompt: list[int], timeout: float = 120.0) -> None:
    """The proxy learns routes a little after `serve.run` returns: retry until one request
    goes through."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            served_generate(stub, app, prompt, 4)
            return
        except grpc.RpcError as e:
            if time.monotonic() > deadline or e.code() not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.NOT_FOUND,
            ):
                raise
            time.sleep(0.5)


async def timed_fetches(prefill, cfg: BenchConfig, app: AppConfig, engine: Engine, n_tok: int):
    """Prefill one prompt on the real replica, fetch its held KV `1 + cfg.fetches` times (the
    first is a warm-up), release it. Returns [(bytes, seconds)] of the timed fetches."""
    prompt = make_prompt(cfg, engine, n_tok, salt=n_tok)
    params = SamplingParams(max_tokens=cfg.decode_tokens, temperature=0.0, ignore_eos=True)
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


def make_prompt(cfg: BenchConfig, engine: Engine, n: int, salt: int = 0) -> list[int]:
    rng = random.Random(cfg.seed * 1000003 + salt)
    # Skip the low ids, where make_model's tokenizers keep their special tokens.
    return [rng.randrange(16, engine.info.spec.vocab_size) for _ in range(n)]


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


class _DecodeRuns:
    """Section 1's interleaved decode runs: in-process, then each app, `cfg.repeats` times."""

    def __init__(self, cfg: BenchConfig, res: Results, baseline, engine, stub, prompt) -> None:
        self.cfg, self.res, self.baseline = cfg, res, baseline
        self.engine, self.stub, self.prompt = engine, stub, prompt

    def measure(
        self, modes: list[str], procs: dict[str, int], inproc: list[float], inproc_cpu: list[float]
    ) -> None:
        cfg, res, n = self.cfg, self.res, self.cfg.decode_tokens
        for m in modes:
            wait_ready(self.stub, MODES[m], self.prompt)
        # Warm-up: one full run of each, so no first-call cost lands in the numbers.
        self.baseline.submit(timed_decode, self.engine, self.prompt, n).result()
        for m in modes:
            served_generate(self.stub, MODES[m], self.prompt, n)
            res.served_s[m], res.served_cpu_s[m], res.alone_s[m] = [], {}, []
            res.alone_cpu_s[m], res.engine_thread_s[m], res.loop_cpu_s[m] = [], [], []
            res.alone_proc_cpu_s[m] = {}
        replicas = {m: _decoding_replica(m) for m in modes}
        clocks = {m: _engine_clock(replicas[m], procs.get(f"{m}/{DECODING[m]}")) for m in modes}
        pids = {
            m: {k: pid for k, pid in procs.items() if k == "proxy" or k.startswith(m)}
            for m in modes
        }

        def with_cpu(m: str, fn: Callable[..., T], *args) -> tuple[T, dict[str, float]]:
            """`fn(*args)`, and the CPU seconds per output token each of `m`'s processes (and
            this one) spent meanwhile."""
            before, client_before = cpu_seconds(pids[m]), time.process_time()
            result = fn(*args)
            after, client_after = cpu_seconds(pids[m]), time.process_time()
            cpu = {k: (after[k] - before[k]) / n for k in before if k in after}
            cpu["client (this process)"] = (client_after - client_before) / n
            return result, cpu

        def time_alone(m: str) -> None:
            """Its replica's engine alone, in its own process: per token, wall and CPU."""

            def alone() -> tuple[float, float]:
                return replicas[m].time_decode.remote(self.prompt, n).result()

            (wall, cpu), procs_cpu = with_cpu(m, alone)
            res.alone_s[m].append(wall)
            res.alone_cpu_s[m].append(cpu)
            for k, v in procs_cpu.items():
                res.alone_proc_cpu_s[m].setdefault(k, []).append(v)

        for r in range(cfg.repeats):
            # Rotate the order (in-process first, then second, ...) so that no app always runs
            # right after the in-process engine, or right after another app.
            order = [None, *modes]
            order = order[r % len(order) :] + order[: r % len(order)]
            for m in order:
                if m is None:
                    wall, cpu = self.baseline.submit(
                        timed_decode, self.engine, self.prompt, n
                    ).result()
                    inproc.append(wall)
                    inproc_cpu.append(cpu)
                    continue
                if r % 2:  # its replica's engine alone, before the served run or after it
                    time_alone(m)
                total_a, step_a = replicas[m].engine_cpu.remote().result()
                s, cpu_per_token = with_cpu(
                    m, served_generate, self.stub, MODES[m], self.prompt, n, clocks[m]
                )
                total_b, step_b = replicas[m].engine_cpu.remote().result()
                res.loop_cpu_s[m].append(((total_b - total_a) - (step_b - step_a)) / (n - 1))
                res.served_s[m].append(per_token(s.token_times))
                if (split := engine_thread_split(s, n)) is not None:
                    res.engine_thread_s[m].append(split)
                for k, v in cpu_per_token.items():
                    res.served_cpu_s[m].setdefault(k, []).append(v)
                if not r % 2:
                    time_alone(m)
                if m == "disaggregated":
                    t = s.last.timing
                    res.incl_transfer_s.append(
                        (t.total_seconds - t.time_to_first_token_seconds) / (n - 1)
                    )
            log(
                f"decode run {r + 1}/{cfg.repeats}: in-process {inproc[-1] * 1e3:.2f} ms/tok"
                + "".join(f", {m} {res.served_s[m][-1] * 1e3:.2f}" for m in modes)
            )


def _baseline_thread(nice: int | None, cpus: tuple[int, ...]) -> None:
    """The baseline's thread gets the decode replica's priority and the engine cores."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    _set_thread_niceness(nice)


def _set_thread_niceness(nice: int | None) -> None:
    """Linux niceness is per thread: give the baseline's thread the replicas' priority."""
    if nice is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as e:  # lowering it needs privileges; the report shows what we got
        log(f"could not set the baseline thread's niceness to {nice}: {e}")


def _thread_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def run(grpc_port: int, cfg: BenchConfig) -> Results:
    """Deploy the benchmark's apps on the running Serve, measure, delete them again."""
    from ray import serve

    from cluster.serving.app import build_app

    _ensure_model(cfg)
    app = app_config(cfg)
    res = Results(cfg, app, started=datetime.datetime.now().astimezone().isoformat("T", "seconds"))
    res.load_before = os.getloadavg()
    began = time.perf_counter()
    old_threads = torch.get_num_threads()
    modes = ["disaggregated"] + (["colocated"] if cfg.colocated else [])
    apps = {
        "disaggregated": app,
        "colocated": replace(app, mode="colocated", name=APP_COLOCATED),
        "serve-relay": replace(app, token_stream="serve", name=APP_SERVE_RELAY),
    }
    baseline: ThreadPoolExecutor | None = None
    try:
        log(f"deploying {', '.join(MODES[m] for m in modes)} ({cfg.preset}: {cfg.model_dir})")
        for m in modes:
            serve.run(build_app(apps[m]), name=MODES[m], route_prefix=f"/{MODES[m]}")
        procs = serving_processes()
        res.niceness = {k: v for k, pid in procs.items() if (v := niceness(pid)) is not None}
        res.proxy_env = node_env(procs["proxy"]) if "proxy" in procs else None
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        baseline = ThreadPoolExecutor(
            1,
            initializer=_baseline_thread,
            initargs=(res.niceness.get("disaggregated/Decode"), cfg.engine_cpus),
        )
        res.niceness["in-process baseline"] = baseline.submit(_thread_niceness).result()
        # Made on its thread, as the replicas make theirs on the engine cores.
        engine = baseline.submit(Engine, app.engine_config("colocated")).result()
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        short = make_prompt(cfg, engine, cfg.short_prompt)
        runs = _DecodeRuns(cfg, res, baseline, engine, stub, short)
        runs.measure(modes, procs, res.inproc_s, res.inproc_cpu_s)

        prefill = serve.get_deployment_handle("Prefill", app_name=APP)
        loop = asyncio.new_event_loop()
        try:
            for n_tok in cfg.long_prompts:
                res.fetch[n_tok] = loop.run_until_complete(
                    timed_fetches(prefill, cfg, app, engine, n_tok)
                )
                b, s = res.fetch[n_tok][-1]
                log(f"KV fetch {n_tok} tokens: {b / 1e6:.1f} MB in {s * 1e3:.1f} ms")
        finally:
            loop.close()

        for n_tok in cfg.long_prompts:
            # A new prompt every run: a repeated one would be served from the prefix cache.
            prompts = [
                make_prompt(cfg, engine, n_tok, salt=7 * n_tok + 1000 * r)
                for r in range(cfg.ttft_runs + 1)
            ]
            served_generate(stub, APP, prompts[0], TTFT_TOKENS)  # warm-up at this length
            res.ttft[n_tok] = []
            for prompt in prompts[1:]:
                s = served_generate(stub, APP, prompt, TTFT_TOKENS)
                t = s.last.timing
                res.ttft[n_tok].append(
                    {
                        "client_ttft": s.token_times[0] - s.call_at,
                        "ttft": t.time_to_first_token_seconds,
                        "prefill": t.prefill_seconds,
                        "transfer": t.kv_transfer_seconds,
                        "gap2": s.token_times[1] - s.token_times[0],
                    }
                )
            x = res.ttft[n_tok][-1]
            log(
                f"TTFT {n_tok} tokens: {x['ttft'] * 1e3:.0f} ms, "
                f"transfer {x['transfer'] * 1e3:.1f} ms"
            )

        if cfg.serve_relay:  # alone: the other apps go first, so their replicas add no load
            for m in modes:
                serve.delete(MODES[m])
            log(f"deploying {APP_SERVE_RELAY}")
            serve.run(
                build_app(apps["serve-relay"]),
                name=APP_SERVE_RELAY,
                route_prefix=f"/{APP_SERVE_RELAY}",
            )
            procs = serving_processes()
            runs.measure(["serve-relay"], procs, res.relay_inproc_s, res.relay_inproc_cpu_s)
        del engine
    finally:
        if baseline is not None:
            baseline.shutdown()
        torch.set_num_threads(old_threads)
        for name in MODES.values():
            try:
                serve.delete(name)
            except Exception as e:  # never deployed, or Serve is going away
                log(f"could not delete app {name}: {e}")
    res.load_after = os.getloadavg()
    res.elapsed_s = time.perf_counter() - began
    return res


# -- the report --------------------------------------------------------------------------------

ROWS = (
    "decode per token, in-process Engine.step",
    "disaggregated (total - TTFT) / (N - 1), incl. KV transfer",
)


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _spread(xs: list[float], scale: float = 1e3) -> str:
    return f"{min(xs) * scale:.2f}–{max(xs) * scale:.2f}"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


CI_LEVEL = 0.95


def median_ci(xs: list[float], level: float = CI_LEVEL) -> tuple[float, float, float]:
    """Distribution-free confidence interval for the median of `xs`: the order statistics
    x(k) and x(n+1-k) for the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k), is
    still at least `level`. Returns (low, high, coverage); with too few values for `level`
    it is (min, max) and the smaller coverage those have."""
    ys = sorted(xs)
    n = len(ys)
    k, coverage = 1, 1.0 - 2.0 * 0.5**n
    while k + 1 <= n // 2:
        below = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n  # P(B <= k)
        if 1.0 - 2.0 * below < level:
            break
        k, coverage = k + 1, 1.0 - 2.0 * below
    return ys[k - 1], ys[n - k], coverage


def _latency_target(what: str, diffs: list[float]) -> str:
    """A Targets row for per-token paired differences against ADDED_LATENCY_TARGET_S."""
    low, high, coverage = median_ci(diffs)
    return (
        f"| {what} ≤ {ADDED_LATENCY_TARGET_S * 1e3:.0f} ms | {_med(diffs) * 1e3:+.2f} ms "
        f"({coverage:.0%} CI of the median {low * 1e3:+.2f} to {high * 1e3:+.2f}, "
        f"{len(diffs)} pairs) | {_bounded_verdict(low, high, ADDED_LATENCY_TARGET_S)} |"
    )


def _bounded_verdict(low: float, high: float, target: float) -> str:
    """PASS when the whole interval is within the target, FAIL when none of it is, else the
    runs do not tell (the noise of the machine is larger than the distance to the target)."""
    if high <= target:
        return "PASS"
    if low > target:
        return "FAIL"
    return "NOT SHOWN"


def render(res: Results, argv: list[str]) -> str:
    cfg, app = res.cfg, res.app
    n = cfg.decode_tokens
    nice = ", ".join(f"{k} {v}" for k, v in res.niceness.items()) or "not read"
    lines = [
        f"# pdserve serving benchmark ({cfg.preset} model)",
        "",
        f"- date: {res.started}; wall time {res.elapsed_s:.0f} s",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, ray {_ray_version()}, "
        f"grpcio {grpc.__version__}",
        f"- load average before: {_load(res.load_before)}; after: {_load(res.load_after)}",
        f"- command: `python -m benchmarks.serving_bench {' '.join(argv)}`".rstrip(),
        f"- config: checkpoint `{cfg.model_dir.name}`, {cfg.dtype} on {cfg.device} "
        f"({device_name(cfg.device)}); 1 router + 1 prefill + "
        f"1 decode replica (colocated app: 1 router + 1 colocated replica); tokens reach the "
        f"router over the direct token stream (serve-relay app: through the Serve handles); "
        f"{cfg.replica_cpus} Ray CPUs and {cfg.torch_threads} torch thread(s) per engine replica; "
        f"the in-process baseline uses the same engine config and "
        f"{cfg.torch_threads} torch thread(s); KV pool {app.decode.cache.num_blocks} blocks x "
        f"{cfg.block_size} tokens per replica; scheduler token budget {cfg.chunk_tokens} per "
        f"step (a {max(cfg.long_prompts)}-token prompt prefills in "
        f"{-(-max(cfg.long_prompts) // cfg.chunk_tokens)} chunks); KV transport grpc, chunks "
        f"of at most {cfg.max_chunk_bytes} bytes; {cfg.repeats} repeats, medians reported",
        f"- CPU priority (nice): {nice}",
        f"- proxy to router: {_proxy_transport(res.proxy_env)}",
        f"- cores: {_cores(cfg)}",
        "",
        f"## 1. Decode latency per output token (batch 1, greedy, ignore_eos, {cfg.short_prompt}-"
        f"token prompt, N = {n})",
        "",
        "Per run: mean step over output tokens 2..N (client-side message arrival times when "
        "served), so neither prefill nor KV transfer is included. Two references: the decoding "
        "replica's own engine alone (`time_decode`: the same engine, weights and process, "
        "stepped in a plain loop with nothing of the serving path around it, run next to each "
        "served run), and an engine of the same config in this process (interleaved, the order "
        "rotated every repeat). Added = median of the paired (served − reference) differences. "
        "Two engines of one config differ by themselves (where their weights landed in memory), "
        "so the second reference carries that difference too: its row \"this process's engine "
        "− the replica's engine\" shows it.",
        "",
        "| metric | median (ms) | runs min–max (ms) |",
        "|---|---|---|",
    ]
    added: dict[str, list[float]] = {}  # mode -> paired differences, vs this process's engine
    added_same: dict[str, list[float]] = {}  # mode -> vs its replica's engine alone
    lines.append(f"| {ROWS[0]} | {_med(res.inproc_s) * 1e3:.2f} | {_spread(res.inproc_s)} |")
    for mode, xs in res.served_s.items():
        if not xs:
            continue
        base = _baseline(res, mode)
        if base is not res.inproc_s:
            lines.append(
                f"| {ROWS[0]}, paired with the next app's runs | {_med(base) * 1e3:.2f} | "
                f"{_spread(base)} |"
            )
        diffs = [s - i for s, i in zip(xs, base, strict=True)]
        alone = res.alone_s[mode]
        same = [s - a for s, a in zip(xs, alone, strict=True)]
        added[mode] = diffs
        added_same[mode] = same
        label = LABELS[mode]
        lines += [
            f"| decode per token, {label}, via Serve + gRPC | {_med(xs) * 1e3:.2f} | "
            f"{_spread(xs)} |",
            f"| decode per token, {label}: its replica's engine alone | "
            f"{_med(alone) * 1e3:.2f} | {_spread(alone)} |",
            f"| added per token, {label}, vs its replica's engine alone | "
            f"{_med(same) * 1e3:+.2f} | {_spread(same)} |",
            f"| added per token, {label} | {_med(diffs) * 1e3:+.2f} | {_spread(diffs)} |",
        ]
        gap = [i - a for i, a in zip(base, alone, strict=True)]
        lines.append(
            f"| this process's engine − the {label} replica's engine, both alone | "
            f"{_med(gap) * 1e3:+.2f} | {_spread(gap)} |"
        )
    lines.append(
        f"| {ROWS[1]} | {_med(res.incl_transfer_s) * 1e3:.2f} | {_spread(res.incl_transfer_s)} |"
    )
    lines += _cpu_table(res)
    lines += _engine_thread_table(res)
    lines += [
        "",
        "## 2. KV transfer throughput (grpc, loopback, fetched by this process)",
        "",
        f"`GrpcKVClient.fetch` of a prompt's KV held by the prefill replica; {cfg.fetches} timed "
        "fetches of the same lease after one warm-up; bytes = assembled K + V `nbytes`.",
        "",
        "| prompt tokens | KV bytes (MB) | fetch median (ms) | KV fetch throughput (GB/s) |",
        "|---|---|---|---|",
    ]
    for n_tok, fs in res.fetch.items():
        nbytes = fs[0][0]
        sec = _med([s for _, s in fs])
        gbs = _med([b / s / 1e9 for b, s in fs])
        lines.append(f"| {n_tok} | {nbytes / 1e6:.1f} | {sec * 1e3:.1f} | {gbs:.2f} |")
    lines += [
        "",
        f"## 3. KV transfer as a share of TTFT (disaggregated, {TTFT_TOKENS} output tokens)",
        "",
        "From the final message's `timing`: `kv_transfer_seconds` is measured by the decode "
        "worker from before `GrpcKVClient.fetch` until the KV is imported into its engine, so it "
        "covers the fetch, the wait for the engine thread and the copy into the decode pool "
        "(the ReleaseKV call runs during the copy). The transfer starts after the first token "
        "was streamed, so it is not inside TTFT; the conservative share divides by TTFT + "
        "transfer. Client TTFT is from the call to the first message; the 1st→2nd token gap is "
        "what the client sees of the transfer (plus the decode hop and one decode step). Every "
        f"run sends a prompt of its own, so none is served from the prefix cache. Medians of "
        f"{cfg.ttft_runs} runs per length after a warm-up.",
        "",
        "| prompt tokens | client TTFT (ms) | server TTFT (ms) | prefill (ms) | KV transfer (ms) "
        "| 1st→2nd token gap (ms) | KV transfer / TTFT | KV transfer / (TTFT + transfer) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    shares: dict[int, tuple[float, float]] = {}
    for n_tok, rows in res.ttft.items():

        def m(key: str, rows=rows) -> float:
            return _med([r[key] for r in rows])

        share = _med([r["transfer"] / r["ttft"] for r in rows])
        cons = _med([r["transfer"] / (r["ttft"] + r["transfer"]) for r in rows])
        shares[n_tok] = (share, cons)
        lines.append(
            f"| {n_tok} | {m('client_ttft') * 1e3:.1f} | {m('ttft') * 1e3:.1f} | "
            f"{m('prefill') * 1e3:.1f} | {m('transfer') * 1e3:.1f} | {m('gap2') * 1e3:.1f} | "
            f"{share:.1%} | {cons:.1%} |"
        )
    lines += [
        "",
        "## Targets",
        "",
        "| target | measured | result |",
        "|---|---|---|",
    ]
    for mode in added:
        if mode == "serve-relay":  # a comparison, not the default configuration
            continue
        for reference, diffs in (
            ("its replica's engine alone", added_same[mode]),
            ("an engine in this process", added[mode]),
        ):
            lines.append(
                _latency_target(f"added latency per output token, {mode}, vs {reference}", diffs)
            )
    for mode in _thread_modes(res):
        if mode == "serve-relay":
            continue
        lines.append(
            _latency_target(
                f"serving's cost to the {mode} engine thread per output token (off CPU + loop "
                "work; Engine.step's own CPU time taken as equal)",
                lost_by_engine(res, mode),
            )
        )
    for n_tok, (share, cons) in shares.items():
        lines.append(
            f"| KV transfer ≤ {TRANSFER_SHARE_TARGET:.0%} of TTFT, {n_tok}-token prompt "
            f"| {share:.1%} | {_verdict(share <= TRANSFER_SHARE_TARGET)} |"
        )
        lines.append(
            f"| KV transfer ≤ {TRANSFER_SHARE_TARGET:.0%} of (TTFT + transfer), {n_tok}-token "
            f"prompt (conservative) | {cons:.1%} | {_verdict(cons <= TRANSFER_SHARE_TARGET)} |"
        )
    lines += [
        "",
        "An added-latency target is PASS when the whole confidence interval of the median "
        "paired difference (distribution-free, from the order statistics) is at or under it, "
        "FAIL when all of it is above, NOT SHOWN when it straddles the target: then this "
        "machine's run-to-run noise is larger than the distance to the target, and more "
        "repeats (or a quieter machine) are needed to tell.",
        "",
        "The presets' max_position_embeddings is 2048 and the context counts generated tokens: "
        "a 2047-token prompt finishes on the prefill's token (length) and moves no KV, so the "
        f'"2048-token" case uses {max(cfg.long_prompts)} prompt tokens '
        f"({-(-max(cfg.long_prompts) // cfg.block_size)} KV blocks, as for 2048).",
    ]
    return "\n".join(lines) + "\n"


def _baseline(res: Results, mode: str, cpu: bool = False) -> list[float]:
    """The in-process runs (wall, or CPU with `cpu`) that `mode`'s runs are paired with."""
    if mode == "serve-relay":
        return res.relay_inproc_cpu_s if cpu else res.relay_inproc_s
    return res.inproc_cpu_s if cpu else res.inproc_s


def _cpu_table(res: Results) -> list[str]:
    modes = [m for m in res.served_cpu_s if res.served_cpu_s[m]]
    if not modes:
        return []
    names = sorted({k.split("/")[-1] for m in modes for k in res.served_cpu_s[m]})
    heads = [h for m in modes for h in (m, f"{m}: engine alone", f"{m}: served − alone")]
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK") / res.cfg.decode_tokens
    lines = [
        "",
        "CPU time per output token by process (ms, median of runs; /proc utime + stime over "
        f"a whole served run, prefill included, divided by N; /proc counts whole ticks, "
        f'{tick_ms:.2f} ms per token here). "engine alone": the same over '
        "the run of the decoding replica's engine alone next to it, when the serving path is "
        "idle (each process's background work: Ray's and Serve's own threads, health checks, "
        'metrics). "served − alone": median of the paired differences, what serving the '
        "tokens cost each process.",
        "",
        "| process | " + " | ".join(heads) + " |",
        "|---|" + "---|" * len(heads),
        "| in-process baseline (engine thread) | "
        + " | ".join(f"{_ms(_baseline(res, m, cpu=True))} | | " for m in modes)
        + "|",
    ]
    for name in names:
        cells = []
        for m in modes:
            served = _by_process(res.served_cpu_s[m], name)
            alone = _by_process(res.alone_proc_cpu_s.get(m, {}), name)
            paired = len(served) == len(alone) > 0
            diff = [a - b for a, b in zip(served, alone, strict=True)] if paired else []
            cells += [_ms(served), _ms(alone), f"{_med(diff) * 1e3:+.2f}" if diff else "–"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _by_process(runs: dict[str, list[float]], name: str) -> list[float]:
    return next((v for k, v in runs.items() if k.split("/")[-1] == name), [])


def _ms(xs: list[float]) -> str:
    return f"{_med(xs) * 1e3:.2f}" if xs else "–"


def _thread_modes(res: Results) -> list[str]:
    """The modes whose every served run has the engine thread's accounting."""
    return [
        m
        for m, runs in res.engine_thread_s.items()
        if runs and len(runs) == len(res.alone_s[m]) == len(res.loop_cpu_s[m])
    ]


def lost_by_engine(res: Results, mode: str) -> list[float]:
    """Per pair: what serving cost the decoding engine thread per token, from its own
    accounting: its time off CPU beyond that of the same engine alone, plus its loop's CPU
    work outside `Engine.step`. Leaves out the step's own CPU time, the same code in both,
    whose paired difference is dominated by the machine's speed changing between the runs."""
    return [
        (waiting + other) - (wall - cpu) + loop
        for (_, waiting, other), wall, cpu, loop in zip(
            res.engine_thread_s[mode],
            res.alone_s[mode],
            res.alone_cpu_s[mode],
            res.loop_cpu_s[mode],
            strict=True,
        )
    ]


def _engine_thread_table(res: Results) -> list[str]:
    """Where the decoding engine thread's time per token went, served and alone, and the
    paired served − alone differences of its on-CPU and off-CPU parts (their sum is the added
    latency against the replica's engine alone)."""
    modes = _thread_modes(res)
    if not modes:
        return []
    lines = [
        "",
        "The decoding replica's engine thread, per output token over tokens 2..N (ms, medians "
        "of runs). Served: its scheduler accounting (/proc/PID/task/TID/schedstat) read by this "
        "client when token 2 and token N arrived, the rest of the client's interval being time "
        "off CPU for other reasons (waiting for the GIL or a lock, or idle). Alone: "
        "`time_decode`'s wall and thread CPU time. The paired differences split the added "
        "latency into time the engine lost off CPU (the serving path taking the GIL or the "
        "core) and the difference in its own CPU time (extra work per step, or the machine "
        "running slower during one run of the pair).",
        "",
        "| engine thread | on CPU | of it outside Engine.step | waiting for a CPU | off CPU "
        "otherwise | off CPU, served − alone (CI) | on CPU, served − alone (CI) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in modes:
        runs = res.engine_thread_s[m]
        on_cpu = [r[0] for r in runs]
        off_cpu = [r[1] + r[2] for r in runs]
        alone_off = [w - c for w, c in zip(res.alone_s[m], res.alone_cpu_s[m], strict=True)]
        d_off = [s - a for s, a in zip(off_cpu, alone_off, strict=True)]
        d_on = [s - a for s, a in zip(on_cpu, res.alone_cpu_s[m], strict=True)]
        lines += [
            f"| {LABELS[m]}, served | {_med(on_cpu) * 1e3:.2f} | "
            f"{_med(res.loop_cpu_s[m]) * 1e3:.3f} | {_med([r[1] for r in runs]) * 1e3:.2f} | "
            f"{_med([r[2] for r in runs]) * 1e3:.2f} | {_with_ci(d_off)} | {_with_ci(d_on)} |",
            f"| {LABELS[m]}, its engine alone | {_med(res.alone_cpu_s[m]) * 1e3:.2f} | | "
            f"{_med(alone_off) * 1e3:.2f} (both kinds) | | | |",
        ]
    lines += [
        "",
        "What serving cost the engine thread per token (its extra time off CPU plus its loop's "
        "work outside `Engine.step`, paired per run): "
        + "; ".join(f"{LABELS[m]} {_with_ci(lost_by_engine(res, m))} ms" for m in modes)
        + ". This leaves out the one part the pairs cannot measure finely on a machine whose "
        "speed changes from run to run: a difference in the CPU time of `Engine.step` itself "
        "(the same code on the same thread in both runs; the on-CPU column above shows its "
        "paired difference with that noise in it).",
    ]
    return lines


def _with_ci(diffs: list[float]) -> str:
    low, high, _ = median_ci(diffs)
    return f"{_med(diffs) * 1e3:+.2f} ({low * 1e3:+.2f} to {high * 1e3:+.2f})"


def _cores(cfg: BenchConfig) -> str:
    if not cfg.engine_cpus:
        return "not pinned: every process may run on every core"
    engine = format_cpu_list(cfg.engine_cpus)
    rest = format_cpu_list(set(range(os.cpu_count() or 1)) - set(cfg.engine_cpus))
    return (
        f"engine threads (replicas' and the in-process baseline's) on {engine} "
        f"(`engine_cpus`); Ray's processes, the proxies, the router and this client on {rest}"
    )


def _proxy_transport(env: dict[str, str] | None) -> str:
    if env is None:
        return "not read (this script did not start the Ray it uses)"
    if env.get("RAY_SERVE_PROXY_USE_GRPC") == "1":
        return "over gRPC to the router's replica (RAY_SERVE_PROXY_USE_GRPC=1 in the proxy)"
    return "Ray actor calls (RAY_SERVE_PROXY_USE_GRPC not 1 in the proxy)"


def _load(x: tuple[float, float, float]) -> str:
    return " ".join(f"{v:.2f}" for v in x) + " (1, 5, 15 min)"


def _ray_version() -> str:
    import ray

    return ray.__version__


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- driver ------------------------------------------------------------------------------------


@contextlib.contextmanager
def local_serve() -> Iterator[int]:
    """A fresh local Ray of our own (never someone else's cluster) with Serve and its gRPC
    proxy, set up as `pdserve serve` sets up its local Ray; yields the proxy's gRPC port."""
    import ray
    from ray import serve

    from cluster.serving.app import GRPC_SERVICER, apply_node_env

    apply_node_env()
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="warning")
    try:
        grpc_port, http_port = _free_port(), _free_port()
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
        )
        try:
            yield grpc_port
        finally:
            serve.shutdown()
    finally:
        ray.shutdown()


@contextlib.contextmanager
def deployed(configs: list[AppConfig]) -> Iterator[None]:
    """Each app (named by its config's `name`, at route /name) deployed on the running Serve
    for the block; all of them deleted after, whatever happened."""
    from ray import serve

    from cluster.serving.app import build_app

    try:
        for cfg in configs:
            log(f"deploying {cfg.name}")
            serve.run(build_app(cfg), name=cfg.name, route_prefix=f"/{cfg.name}")
        yield
    finally:
        for cfg in configs:
            try:
                serve.delete(cfg.name)
            except Exception as e:  # never deployed, or Serve is going away
                log(f"could not delete app {cfg.name}: {e}")


def served_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options of the benchmarks that deploy apps of their own (`measure_served`): the
    checkpoint, the report file and the Serve to use."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--model-dir", default=None, help="checkpoint dir (default: the preset's)")
    p.add_argument("--out", default=None, help="also write the Markdown report here")
    p.add_argument(
        "--grpc-port",
        type=int,
        default=0,
        help="use the Serve already running with this gRPC "
        "port (pdserve's servicer) instead of starting a local Ray",
    )
    return p


def measure_served(a: argparse.Namespace, measure: Callable[[str, int], T]) -> tuple[T, float]:
    """`measure(checkpoint dir, grpc port)` with `served_parser`'s options; returns its result
    and the wall seconds it took."""
    model_dir = str(a.model_dir or ensure_model(a.preset, default_model_dir(a.preset)))
    began = time.perf_counter()
    result = on_serve(a.grpc_port, lambda port: measure(model_dir, port))
    return result, time.perf_counter() - began


def on_serve(grpc_port: int, measure: Callable[[int], T]) -> T:
    """`measure(port)` on the Serve whose gRPC proxy listens on `grpc_port`, or, when it is 0,
    on a local Ray and Serve started for it and shut down after."""
    if grpc_port:
        return measure(grpc_port)
    with local_serve() as port:
        return measure(port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print the Markdown report and return it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, cfg = parse_args(argv)
    if args.grpc_port:
        res = run(args.grpc_port, cfg)
    else:
        # Read by the raylet this starts (it inherits our environment), so ours only.
        os.environ["RAY_worker_niceness"] = str(cfg.worker_niceness)
        if cfg.engine_cpus:  # Ray's processes inherit the rest; the engine threads move back
            reserve_for_engines(cfg.engine_cpus)
        with local_serve() as grpc_port:
            res = run(grpc_port, cfg)
    report = render(res, argv)
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, "utf-8")
    return report


if __name__ == "__main__":
    main()
