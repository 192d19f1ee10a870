"""Each pool scales on its own load, on a real local Ray; metrics reach Prometheus; overload is
refused at once. Replica counts are read from Serve itself, never from pdserve's bookkeeping."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from cluster.serving.autoscaling import AutoscalingSettings
from tests.ray_fixtures import app_metadata, deploy, small_app_config, stub, wait_for_idle

APP = "scaling"


def running_replicas(app: str) -> dict[str, int]:
    from ray import serve
    from ray.serve._private.common import ReplicaState

    deployments = serve.status().applications[app].deployments
    return {name: d.replica_states.get(ReplicaState.RUNNING, 0) for name, d in deployments.items()}


@pytest.fixture(scope="module")
def scaling_app(ray_serve, tokenizer_model_dir):
    from ray import serve

    base = small_app_config(str(tokenizer_model_dir))
    fast = dict(upscale_delay_s=1.0, downscale_delay_s=5.0, look_back_period_s=2.0)
    prefill = replace(
        base.prefill,
        # The load repeats a few prompts; with prefix caching their prefill would be nearly
        # free and never queue. Off here, so repeated prompts cost what distinct ones would.
        cache=replace(base.prefill.cache, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=128),
        autoscaling=AutoscalingSettings(
            min_replicas=1, max_replicas=2, targets=(("queued_prompt_tokens", 1024.0),), **fast
        ),
    )
    decode = replace(
        base.decode,
        autoscaling=AutoscalingSettings(
            min_replicas=1, max_replicas=2, targets=(("running", 6.0), ("kv_usage", 0.9)), **fast
        ),
    )
    deploy(replace(base, prefill=prefill, decode=decode), APP, "/scaling")
    yield ray_serve
    serve.delete(APP)


@pytest.fixture(scope="module")
def reference(tokenizer_model_dir):
    """The engine's own greedy output, in this process, for the prompts the load uses."""
    engine = Engine(
        EngineConfig(
            ModelConfig(str(tokenizer_model_dir)),
            CacheConfig(num_blocks=1024),
            SchedulerConfig(max_num_batched_tokens=2048),
        )
    )
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(ids: tuple[int, ...], n: int) -> list[int]:
        if (ids, n) not in cache:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            (out,) = engine.generate([Request(f"ref{len(cache)}", ids, params)])
            cache[(ids, n)] = out.token_ids
        return cache[(ids, n)]

    yield greedy
    assert engine.stats().kv_blocks_used == 0


def run_load(ends, cases, concurrency: int, stop: threading.Event, results: list) -> None:
    """Send `cases` round-robin from `concurrency` threads until `stop` is set."""

    def worker(k: int) -> None:
        i = k
        while not stop.is_set():
            ids, n = cases[i % len(cases)]
            sampling = pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            request = pb.GenerateRequest(prompt_token_ids=list(ids), sampling=sampling)
            msgs = list(stub(ends).Generate(request, metadata=app_metadata(APP)))
            results.append((ids, n, [t for m in msgs for t in m.token_ids]))
            i += concurrency

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker, k) for k in range(concurrency)]:
            f.result()


def scale_under(ends, cases, concurrency: int, grow: str, stay: str, timeout: float = 120.0):
    """Drive load until `grow` reaches 2 running replicas; `stay` must never leave 1."""
    stop, results, seen = threading.Event(), [], []
    loader = threading.Thread(target=run_load, args=(ends, cases, concurrency, stop, results))
    loader.start()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            counts = running_replicas(APP)
            seen.append(counts)
            if counts.get(grow) == 2:
                time.sleep(3.0)  # keep serving across the new replica for a moment
                break
            time.sleep(0.5)
    finally:
        stop.set()
        loader.join()
    assert any(c.get(grow) == 2 for c in seen), f"{grow} never scaled up: {seen[-5:]}"
    assert all(c.get(stay) == 1 for c in seen), f"{stay} left its minimum: {seen}"
    return results


def shrink_under_light_load(ends, cases, timeout: float = 120.0) -> list:
    """Keep one client sending while both pools return to their minimum, so requests are in
    flight while replicas are removed. Returns that client's results."""
    stop, results = threading.Event(), []
    loader = threading.Thread(target=run_load, args=(ends, cases, 1, stop, results))
    loader.start()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            counts = running_replicas(APP)
            if counts.get("Prefill") == 1 and counts.get("Decode") == 1:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"pools did not return to their minimum: {counts}")
        time.sleep(2.0)
    finally:
        stop.set()
        loader.join()
    return results


def check(results, reference) -> None:
    assert results
    for ids, n, got in results:
        assert got == reference(ids, n), f"wrong output for a {len(ids)}-token prompt"


def test_prefill_heavy_load_scales_prefill_only_then_back(scaling_app, reference):
    cases = [(tuple((i * 31 + j * 7) % 4000 + 60 for j in range(900)), 1 + i % 2) for i in range(4)]
    results = scale_under(scaling_app, cases, concurrency=12, grow="Prefill", stay="Decode")
    results += shrink_under_light_load(scaling_app, cases)
    check(results, reference)
    wait_for_idle(scaling_app, APP, {"prefill", "decode"})


def test_decode_heavy_load_scales_decode_only_then_back(scaling_app, reference):
    cases = [(tuple(range(10 + i, 15 + i)), 400) for i in range(4)]
    results = scale_under(scaling_app, cases, concurrency=16, grow="Decode", stay="Prefill")
    results += shrink_under_light_load(scaling_app, [(ids, 40) for ids, _ in cases])
    check(results, reference)
    wait_for_idle(scaling_app, APP, {"prefill", "decode"})


def test_pool_status_reports_replicas_and_load_signals(scaling_app):
    stats = stub(scaling_app).GetStats(pb.GetStatsRequest(), metadata=app_metadata(APP))
    pools = {p.pool: p for p in stats.pools}
    assert pools["prefill"].current_replicas == pools["prefill"].target_replicas == 1
    assert (pools["decode"].min_replicas, pools["decode"].max_replicas) == (1, 2)
    assert [s.name for s in pools["prefill"].signals] == ["queued_prompt_tokens"]
    assert {s.name for s in pools["decode"].signals} == {"running", "kv_usage"}


def _histogram_count(metrics_port: int, name: str, app: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    total = 0.0
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == f"{name}_count" and sample.labels.get("application") == app:
                total += sample.value
    return total


def _settled_count(metrics_port: int, name: str, app: str, quiet_s: float = 12.0) -> float:
    """The histogram's count once it has not moved for `quiet_s` (longer than Ray's 10 s
    metrics report interval), so observations of earlier tests still on their way to the
    exporter do not land inside the next measurement."""
    deadline = time.monotonic() + 90
    count, since = _histogram_count(metrics_port, name, app), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"{name} never settled"
        time.sleep(1.0)
        now = _histogram_count(metrics_port, name, app)
        if now != count:
            count, since = now, time.monotonic()
    return count


def test_prometheus_export_has_pdserve_metrics(scaling_app):
    name = "ray_pdserve_time_to_first_token_seconds"
    before = _settled_count(scaling_app.metrics_port, name, APP)
    sampling = pb.SamplingParams(max_tokens=3, temperature=0.0)
    for i in range(5):
        request = pb.GenerateRequest(prompt_token_ids=[7, 8, 9, i], sampling=sampling)
        list(stub(scaling_app).Generate(request, metadata=app_metadata(APP)))
    deadline = time.monotonic() + 60
    while _histogram_count(scaling_app.metrics_port, name, APP) < before + 5:
        assert time.monotonic() < deadline, "TTFT count never reached the requests served"
        time.sleep(1.0)
    time.sleep(3.0)  # no late extra observations either
    assert _histogram_count(scaling_app.metrics_port, name, APP) == before + 5
    text = urllib.request.urlopen(f"http://127.0.0.1:{scaling_app.metrics_port}/metrics").read()
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    for metric in (
        "ray_pdserve_kv_transfer_bytes",
        "ray_pdserve_prefill_time_seconds",
        "ray_pdserve_kv_cache_usage",
        "ray_pdserve_generation_tokens",
        "ray_pdserve_requests_finished",
    ):
        assert metric in families, f"{metric} missing from the Prometheus export"
    transferred = sum(
        s.value
        for s in families["ray_pdserve_kv_transfer_bytes"].samples
        if s.labels.get("application") == APP
    )
    assert transferred > 0
    usage = [s.value for s in families["ray_pdserve_kv_cache_usage"].samples]
    assert all(0.0 <= u <= 1.0 for u in usage)


def test_overload_is_refused_at_once(ray_serve, tokenizer_model_dir):
    from ray import serve

    base = small_app_config(str(tokenizer_model_dir))
    tight = replace(
        base.prefill,
        max_ongoing_requests=1,
        max_queued_requests=1,
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64),
    )
    deploy(replace(base, prefill=tight), "overload", "/overload")
    try:
        long_prompt = [(j * 13) % 4000 + 50 for j in range(1500)]
        sampling = pb.SamplingParams(max_tokens=1, temperature=0.0)

        def call(_):
            start = time.monotonic()
            request = pb.GenerateRequest(prompt_token_ids=long_prompt, sampling=sampling)
            try:
                list(stub(ray_serve).Generate(request, metadata=app_metadata("overload")))
                return "ok", time.monotonic() - start
            except grpc.RpcError as e:
                return e.code(), time.monotonic() - start

        with ThreadPoolExecutor(12) as pool:
            outcomes = list(pool.map(call, range(12)))
        refused = [t for code, t in outcomes if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        served = [t for code, t in outcomes if code == "ok"]
        assert {code for code, _ in outcomes} <= {"ok", grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert refused and served, outcomes
        assert max(refused) < max(served), outcomes  # refused at once, not after a wait

        def post(_):
            start = time.monotonic()
            body = json.dumps({"prompt": long_prompt, "max_tokens": 1, "temperature": 0})
            request = urllib.request.Request(
                f"{ray_serve.http_base}/overload/v1/completions",
                data=body.encode(),
                headers={"content-type": "application/json"},
            )
            try:
                urllib.request.urlopen(request, timeout=120).read()
                return 200, time.monotonic() - start
            except urllib.error.HTTPError as e:
                error = json.loads(e.read())["error"]
                assert error["message"] and error["type"]
                return e.code, time.monotonic() - start

        with ThreadPoolExecutor(12) as pool:
            outcomes = list(pool.map(post, range(12)))
        refused = [t for code, t in outcomes if code in (429, 503)]
        served = [t for code, t in outcomes if code == 200]
        assert {code for code, _ in outcomes} <= {200, 429, 503}, outcomes
        assert refused and served, outcomes
        assert max(refused) < max(served), outcomes
        wait_for_idle(ray_serve, "overload", {"prefill", "decode"})
    finally:
        serve.delete("overload")
