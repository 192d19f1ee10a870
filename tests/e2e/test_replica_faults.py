"""A replica dies, no request fails: replicas of an app of its own ("faults", 2 routers, 2
prefill and 2 decode replicas) are killed (`ray.kill`, as a crashed process) under concurrent
streams. When an engine replica dies every stream ends normally with the tokens of an unfaulted
run (greedy: the transformers oracle; seeded: the same request run again afterwards); when a
router dies its own streams fail UNAVAILABLE and the other router's go on. The dead replica
comes back, and every KV block and lease returns to zero."""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.e2e.grpc_calls import greedy_sampling, replace_seed, tokens
from tests.ray_fixtures import app_metadata, deploy, small_app_config, stub, wait_for_idle

FAULTS = "faults"
STREAMS = 12
SEEDED = 4  # of the STREAMS, this many sample (seeded), the rest are greedy
MAX_TOKENS = 96
VOCAB = 4096  # the `tiny` preset's
EXPORT_PERIOD_S = 10.0  # Ray's metrics_report_interval_ms: how often a process's metrics go out


@pytest.fixture(scope="module")
def faults(apps, tokenizer_model_dir):
    from ray import serve

    base = small_app_config(str(tokenizer_model_dir))
    pools = {k: replace(getattr(base, k), replicas=2) for k in ("router", "prefill", "decode")}
    deploy(replace(base, **pools), FAULTS, "/faults")
    yield apps
    serve.delete(FAULTS)


@dataclass
class _Stream:
    request: pb.GenerateRequest
    msgs: list[pb.GenerateResponse] = field(default_factory=list)
    error: grpc.RpcError | None = None

    def read(self, s) -> None:
        try:
            for msg in s.Generate(self.request, metadata=app_metadata(FAULTS)):
                self.msgs.append(msg)
        except grpc.RpcError as e:
            self.error = e


def _requests() -> list[pb.GenerateRequest]:
    out = []
    for i in range(STREAMS):
        rng = random.Random(i)
        sampling = greedy_sampling(MAX_TOKENS)
        if i < SEEDED:
            sampling = replace_seed(sampling, 1000 + i)
            sampling.temperature, sampling.top_p = 1.0, 0.9
        ids = [rng.randrange(VOCAB) for _ in range(24)]
        out.append(pb.GenerateRequest(prompt_token_ids=ids, sampling=sampling))
    return out


def _replica_names(deployment: str) -> list[str]:
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if f"{FAULTS}#{deployment}#" in a["name"]
    )


def _kill(name: str) -> None:
    import ray

    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def _wait_for_replicas(deployment: str, n: int, gone: str, timeout: float = 120.0) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout
    while True:
        status = serve.status().applications[FAULTS].deployments[deployment]
        running = status.replica_states.get("RUNNING", 0)
        names = _replica_names(deployment)
        if running == n and len(names) == n and gone not in names:
            return
        assert time.monotonic() < deadline, f"{deployment} not back to {n}: {status}"
        time.sleep(0.5)


def _run_killing(ends, deployment: str | None, when=None, victim=None, stubs=None) -> list[_Stream]:
    """Run the streams; once `when(streams)` holds, kill one replica of `deployment` (None: no
    kill): `victim` (an actor name), or else the first by name. `stubs[i]` carries stream i
    (default: each on a channel of its own to the Serve proxy). Returns the streams once all
    have ended and the killed replica is back."""
    streams = [_Stream(r) for r in _requests()]
    stubs = stubs or [stub(ends) for _ in streams]
    threads = [
        threading.Thread(target=st.read, args=(s,)) for st, s in zip(streams, stubs, strict=True)
    ]
    for t in threads:
        t.start()
    if deployment is not None:
        deadline = time.monotonic() + 60
        while not when(streams):
            assert time.monotonic() < deadline, "the streams did not get going"
            time.sleep(0.005)
        victim = victim or _replica_names(deployment)[0]
        _kill(victim)
    for t in threads:
        t.join(timeout=120)
    if deployment is not None:
        _wait_for_replicas(deployment, 2, victim)
    return streams


def _each_has(n: int):
    """Every stream still going has `n` messages (all are decoding)."""
    return lambda streams: all(len(st.msgs) >= n for st in streams if st.error is None)


def _first_token_out(streams: list[_Stream]) -> bool:
    """Some stream has its first token: its prefill is done and its KV is on the move, while
    the others are still prefilling or moving theirs."""
    return any(st.msgs for st in streams)


def _exported_migrations(metrics_port: int, want: int) -> int:
    """The faults app's `pdserve_request_migrations_total` in the Prometheus export, polled
    until it equals `want` or 30 s pass (Ray exports every few seconds)."""
    deadline = time.monotonic() + 30.0
    while True:
        got = 0
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read()
        for family in text_string_to_metric_families(text.decode()):
            for sample in family.samples:
                if (
                    sample.name == "ray_pdserve_request_migrations_total"
                    and sample.labels.get("application") == FAULTS
                ):
                    assert sample.labels["from_pool"] == "decode", sample
                    got += int(sample.value)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(1.0)


def _prefill_calls(metrics_port: int) -> int:
    """The calls the faults app's routers made to its Prefill deployment, each try and retry,
    as Serve's own handle counter (`serve_num_router_requests`) has them in the export."""
    calls = 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read()
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "ray_serve_num_router_requests_total"
                and labels.get("application") == FAULTS
                and labels.get("deployment") == "Prefill"
            ):
                calls += int(sample.value)
    return calls


def _settled_prefill_calls(metrics_port: int) -> int:
    """`_prefill_calls` once unchanged for longer than Ray's export period: no call made
    before is still on its way to the export."""
    last, since = _prefill_calls(metrics_port), time.monotonic()
    deadline = since + 90.0
    while time.monotonic() - since < EXPORT_PERIOD_S + 2.0:
        assert time.monotonic() < deadline, "Serve's handle counter never settled"
        time.sleep(1.0)
        now = _prefill_calls(metrics_port)
        if now != last:
            last, since = now, time.monotonic()
    return last


def _prefill_calls_past(metrics_port: int, floor: int) -> int:
    """`_prefill_calls`, polled until it passes `floor` or two export periods pass."""
    deadline = time.monotonic() + 2 * EXPORT_PERIOD_S + 5.0
    while (calls := _prefill_calls(metrics_port)) <= floor and time.monotonic() < deadline:
        time.sleep(1.0)
    return calls


def _check(streams, reference, path, hf, indices: list[int] | None = None) -> int:
    """Every stream ended normally with the unfaulted tokens; returns the migrations.
    `indices`: which of the requests the streams are (all, in order, by default)."""
    failed = [(st.error.code(), st.error.details()) for st in streams if st.error is not None]
    assert not failed, failed
    migrations = 0
    indices = list(range(len(streams))) if indices is None else indices
    for i, st, ref in zip(indices, streams, reference, strict=True):
        got = tokens(st.msgs)
        last = st.msgs[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH and len(got) == MAX_TOKENS
        assert last.usage.completion_tokens == MAX_TOKENS
        if i < SEEDED:
            assert got == tokens(ref.msgs), i
        else:
            hf.assert_greedy(path, list(st.request.prompt_token_ids), got, MAX_TOKENS)
        migrations += last.timing.migrations
    return migrations


def test_a_decode_replica_killed_mid_stream_costs_latency_never_a_request(
    faults, tokenizer_model_dir, hf
):
    streams = _run_killing(faults, "Decode", _each_has(3))
    reference = _run_killing(faults, None)  # the same requests, nothing killed
    migrations = _check(streams, reference, tokenizer_model_dir, hf)
    assert migrations >= 1  # the killed replica was streaming some of them
    assert _exported_migrations(faults.metrics_port, migrations) == migrations
    assert sum(tokens(r.msgs) != [] for r in reference) == STREAMS
    wait_for_idle(faults, FAULTS, {"prefill", "decode"}, timeout=60.0)


def test_a_prefill_replica_killed_around_the_hand_off_costs_no_request(
    faults, tokenizer_model_dir, hf
):
    """Killed as the first prompt's KV starts to move: the others are still prefilling, or
    their KV is on its way from the dead replica; all of them are prefilled again elsewhere
    (the routers called the prefill pool more than once for some of them). On 2 loaded cores
    the kill can land after every KV has moved (nothing to retry): up to 3 rounds, each exact,
    until one shows a retry."""
    reference = _run_killing(faults, None)
    tried = []
    while len(tried) < 3 and not any(c > STREAMS for c in tried):
        before = _settled_prefill_calls(faults.metrics_port)
        streams = _run_killing(faults, "Prefill", _first_token_out)
        tried.append(_prefill_calls_past(faults.metrics_port, before + STREAMS) - before)
        _check(streams, reference, tokenizer_model_dir, hf)
    assert any(c > STREAMS for c in tried), f"prefill calls for {STREAMS} streams: {tried}"
    wait_for_idle(faults, FAULTS, {"prefill", "decode"}, timeout=60.0)


def test_a_router_killed_mid_stream_fails_only_its_own_streams(faults, tokenizer_model_dir, hf):
    """The streams that router was carrying fail UNAVAILABLE at once; the other router's end
    normally and exactly. The engines free what the dead router's requests held (their token
    streams break; leases it held expire). Which router a stream rides is fixed, not left to
    the proxy's choice (which once put all 12 on the survivor): a third go to each router's
    direct endpoint, a third through the Serve proxy (either router; lost or exact)."""
    routers = _router_endpoints()
    victim, survivor = sorted(routers)
    on = {0: "victim", 1: "survivor", 2: "proxy"}
    channels = {
        "victim": grpc.insecure_channel(routers[victim]),
        "survivor": grpc.insecure_channel(routers[survivor]),
    }
    stubs = [
        pb_grpc.GenerationStub(channels[on[i % 3]]) if i % 3 < 2 else stub(faults)
        for i in range(STREAMS)
    ]
    try:
        streams = _run_killing(faults, "Router", _each_has(3), _actor_of(victim), stubs)
    finally:
        for c in channels.values():
            c.close()
    reference = _run_killing(faults, None)
    by_route = {r: [i for i in range(STREAMS) if on[i % 3] == r] for r in on.values()}
    lost = [i for i, st in enumerate(streams) if st.error is not None]
    assert set(by_route["victim"]) <= set(lost), lost
    assert not set(by_route["survivor"]) & set(lost), lost
    assert {streams[i].error.code() for i in lost} == {grpc.StatusCode.UNAVAILABLE}, [
        streams[i].error.details() for i in lost
    ]
    kept = [i for i in range(STREAMS) if i not in lost]
    _check([streams[i] for i in kept], [reference[i] for i in kept], tokenizer_model_dir, hf, kept)
    wait_for_idle(faults, FAULTS, {"prefill", "decode"}, timeout=60.0)


def _router_endpoints() -> dict[str, str]:
    """Each router replica's id -> its direct gRPC endpoint, from the stats registry."""
    import ray

    from cluster.serving.stats_registry import registry

    deadline = time.monotonic() + 30.0
    while True:
        listed = [r for r in ray.get(registry(FAULTS).list.remote()) if r.pool == "router"]
        if len(listed) == 2 and all(r.grpc_endpoint for r in listed):
            return {r.replica_id: r.grpc_endpoint for r in listed}
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)


def _actor_of(replica_id: str) -> str:
    (name,) = [n for n in _replica_names("Router") if n.endswith(f"#{replica_id}")]
    return name
