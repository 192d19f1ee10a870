"""End to end on a real local Ray: router -> prefill pool -> KV over gRPC -> decode pool.

Nothing is mocked: real Serve deployments, the real gRPC proxy and KV transport, the real
engine; transformers' greedy decoding on the same checkpoint is the oracle. Here: outputs on
every replica, streaming, seeds, the prefix cache and the routing that finds it, and what a
client's cancel frees.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from benchmarks.proc_stats import niceness
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.e2e.conftest import CO, ENGINE_CORE, PD
from tests.e2e.grpc_calls import generate, greedy_sampling, replace_seed, tokens
from tests.ray_fixtures import app_metadata, stub, wait_for_idle


def test_32_concurrent_greedy_requests_match_transformers_on_every_replica(
    apps, tokenizer_model_dir, hf
):
    cases = [
        (tuple((7 * i + 13 * j) % 4000 + 50 for j in range(3 + (i * 5) % 60)), 4 + (i * 3) % 21)
        for i in range(32)
    ]

    def run(case):
        ids, n = case
        return generate(
            apps, PD, prompt_token_ids=list(ids), sampling=greedy_sampling(n), request_id=""
        )[0]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, cases))
    prefill_replicas, decode_replicas = set(), set()
    for (ids, n), msgs in zip(cases, results, strict=True):
        hf.assert_greedy(tokenizer_model_dir, ids, tokens(msgs), n)
        last = msgs[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(ids) and last.usage.completion_tokens == n
        assert last.timing.kv_transfer_seconds > 0
        prefill_replicas.add(last.timing.prefill_replica)
        decode_replicas.add(last.timing.decode_replica)
    assert len(prefill_replicas) == 2, prefill_replicas
    assert len(decode_replicas) == 2, decode_replicas
    replicas = wait_for_idle(apps, PD, {"prefill", "decode"})
    assert sorted(r.pool for r in replicas) == ["decode", "decode", "prefill", "prefill"]


def test_first_message_arrives_before_decode_finishes(apps):
    start = time.monotonic()
    msgs, times = generate(apps, PD, prompt="a long story", sampling=greedy_sampling(200))
    assert len(msgs[0].token_ids) == 1  # the prefill hop's token, streamed at once
    assert len(tokens(msgs)) == 200
    first, total = times[0] - start, times[-1] - start
    assert first < total / 4, (first, total)
    t = msgs[-1].timing
    assert t.time_to_first_token_seconds < t.decode_seconds
    assert t.prefill_seconds <= t.time_to_first_token_seconds


@pytest.mark.parametrize("app", [PD, CO])
def test_a_client_cancelling_mid_stream_frees_everything(apps, app):
    """The client goes away after a few tokens: the stream ends CANCELLED, every replica's KV
    blocks come back and the app keeps serving. (That the worker aborts at once, rather than
    running to max_tokens, is shown by tests/decode_worker/test_token_sender.py.)"""
    request = pb.GenerateRequest(prompt="cancel me", sampling=greedy_sampling(1500))
    call = stub(apps).Generate(request, metadata=app_metadata(app))
    got = [next(call) for _ in range(3)]
    assert sum(len(m.token_ids) for m in got) >= 3
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    wait_for_idle(apps, app, {"prefill", "decode"} if app == PD else {"colocated"})
    msgs, _ = generate(apps, app, prompt="still serving", sampling=greedy_sampling(4))
    assert len(tokens(msgs)) == 4


@pytest.mark.parametrize("app", [PD, CO])
def test_a_client_that_stops_reading_then_cancels_stops_the_generation(apps, app):
    """The client reads one message and stops reading; with a small receive window the proxy
    is soon waiting in a write to it when the client cancels. Serve's own proxy handler loses
    that cancel (router/grpc_ingress.py): the generation would run to max_tokens. The replicas'
    token counters show where it stopped."""
    pools = {"prefill", "decode"} if app == PD else {"colocated"}
    before = sum(r.generated_tokens for r in wait_for_idle(apps, app, pools))
    max_tokens = 1900  # the tiny model's context is 2048
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    with grpc.insecure_channel(apps.grpc_target, options=options) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt="read me slowly", sampling=greedy_sampling(max_tokens)),
            metadata=app_metadata(app),
        )
        assert next(call).token_ids
        time.sleep(1.0)
        call.cancel()
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.CANCELLED
    generated = sum(r.generated_tokens for r in wait_for_idle(apps, app, pools)) - before
    assert 0 < generated < max_tokens


def test_seeded_sampling_is_the_same_disaggregated_colocated_alone_and_batched(apps):
    seeded = pb.SamplingParams(
        max_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=77, ignore_eos=True
    )
    ids = [11, 22, 33, 44, 55, 66, 77, 88]

    def run(app, sampling=seeded, prompt_ids=ids):
        return tokens(generate(apps, app, prompt_token_ids=prompt_ids, sampling=sampling)[0])

    alone = {app: run(app) for app in (PD, CO)}
    others = [
        (pb.SamplingParams(max_tokens=12, temperature=0.7, seed=i, ignore_eos=True), [i + 5] * i)
        for i in range(1, 9)
    ]
    batched = {}
    for app in (PD, CO):
        with ThreadPoolExecutor(9) as pool:
            futures = [pool.submit(run, app, s, p) for s, p in others]
            batched[app] = pool.submit(run, app).result()
            for f in futures:
                f.result()
    assert len(alone[PD]) == 16
    assert alone[PD] == alone[CO] == batched[PD] == batched[CO]
    other_seed = run(PD, replace_seed(seeded, 78))
    assert other_seed != alone[PD]
    wait_for_idle(apps, PD, {"prefill", "decode"})
    wait_for_idle(apps, CO, {"colocated"})


def test_a_chats_next_turn_finds_the_last_turns_prompt_cached(apps, tokenizer_model_dir):
    """Multi-turn chat over the OpenAI API on 2 prefill replicas: turn 2's prompt starts with
    all of turn 1's, which prefix-affinity routing sends back to the replica that computed it,
    so every full block of turn 1's prompt comes from the cache. Three conversations, so
    Serve's default routing would miss at least one with probability 7/8."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_model_dir)
    client = openai.OpenAI(base_url=f"{apps.http_base}/pd/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id

    def ids(messages: list[dict]) -> list[int]:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    for n in range(3):
        system = f"Assistant {n}: answer in one short line, never repeat the question. " * 2
        turn = [{"role": "system", "content": system}, {"role": "user", "content": "A colour?"}]
        first = client.chat.completions.create(
            model=model, messages=turn, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        turn += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Another one."},
        ]
        second = client.chat.completions.create(model=model, messages=turn, max_tokens=2)
        before, after = ids(turn[:2]), ids(turn)
        shared = len(os.path.commonprefix([before, after]))  # all of `before`, with this template
        blocks = min(shared, len(after) - 1) // 16
        assert second.usage.prompt_tokens == len(after)
        assert second.usage.prompt_tokens_details.cached_tokens == 16 * blocks > 0, n
    wait_for_idle(apps, PD, {"prefill", "decode"})


def test_a_repeated_prompt_reports_its_cached_prefix(apps):
    """Prefix caching through the whole path: the prompt's full blocks (16 tokens each) are
    reused by the replica that computed them, `usage.cached_prompt_tokens` says so, and the
    tokens do not change. With 2 prefill replicas, prefix-affinity routing sends every repeat
    back to the replica that computed the prompt (Serve's default would pick one at random)."""
    import random

    rng = random.Random(41)
    ids = [rng.randrange(20, 200) for _ in range(40)]
    for app, calls in ((CO, 2), (PD, 4)):
        msgs = [
            generate(apps, app, prompt_token_ids=ids, sampling=greedy_sampling(4))[0]
            for _ in range(calls)
        ]
        cached = [m[-1].usage.cached_prompt_tokens for m in msgs]
        assert cached == [0] + [32] * (calls - 1), (app, cached)
        assert len({m[-1].timing.prefill_replica for m in msgs}) == 1, app
        assert all(tokens(m) == tokens(msgs[0]) for m in msgs), app
    wait_for_idle(apps, PD, {"prefill", "decode"})
    # GetStats shows the colocated replica's cache: at least this prompt's 2 full blocks, free.
    (replica,) = wait_for_idle(apps, CO, {"colocated"})
    assert replica.kv_blocks_cached >= 2 and replica.kv_blocks_used == 0


def test_interleaved_prefixes_each_go_back_to_the_replica_that_cached_them(apps):
    """Four prompts' 48-token prefixes taken in turn, three rounds, on 2 prefill replicas:
    every repeat is sent where its prefix was computed and finds all 3 blocks cached."""
    import random

    rng = random.Random(7)
    prefixes = [[rng.randrange(20, 4000) for _ in range(48)] for _ in range(4)]
    replica_of: dict[int, set[str]] = {}
    before = _prefix_routing(apps.metrics_port, PD).get("cached_prefix", 0)
    for round_ in range(3):
        for i, prefix in enumerate(prefixes):
            ids = [*prefix, 10 + round_, 10 + i]
            last = generate(apps, PD, prompt_token_ids=ids, sampling=greedy_sampling(2))[0][-1]
            assert last.usage.cached_prompt_tokens == (48 if round_ else 0), (round_, i)
            replica_of.setdefault(i, set()).add(last.timing.prefill_replica)
    assert all(len(replicas) == 1 for replicas in replica_of.values()), replica_of
    wait_for_idle(apps, PD, {"prefill", "decode"})
    # The router counted its placements (Prometheus): these 8 repeats went to their prefix.
    deadline = time.monotonic() + 60
    while (placed := _prefix_routing(apps.metrics_port, PD)).get("cached_prefix", 0) < before + 8:
        assert time.monotonic() < deadline, (before, placed)
        time.sleep(1.0)


def _prefix_routing(metrics_port: int, app: str) -> dict[str, float]:
    """`pdserve_prefix_routing_total` of the app's prefill pool, by outcome, from Prometheus."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    return {
        s.labels["outcome"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "ray_pdserve_prefix_routing"
        for s in f.samples
        if s.name.endswith("_total")
        and s.labels.get("application") == app
        and s.labels.get("pool") == "prefill"
    }


def test_the_colocated_engine_thread_runs_on_its_configured_core_only(apps):
    """And the output thread, where a pool has one, on the replica's cores."""
    from ray import serve

    got = serve.get_deployment_handle("Colocated", app_name=CO).cpu_affinity.remote().result()
    assert got["engine"] == list(ENGINE_CORE)
    if len(os.sched_getaffinity(0)) > 1:  # the replica's own threads were not pinned with it
        assert set(got["replica"]) > set(ENGINE_CORE)
    assert got["output"] == []  # on a CPU the engine thread makes the text itself
    pd = serve.get_deployment_handle("Decode", app_name=PD).cpu_affinity.remote().result()
    assert pd["engine"] == pd["replica"]  # no engine_cpus: the engine thread is not pinned
    assert pd["output"] == pd["replica"]  # output_thread on: beside the engine


SERVE_OWN = (b"ray::ProxyActor", b"ray::ServeController")


def test_every_replica_runs_at_the_nice_value_of_a_normal_process(apps):
    """Ray starts its workers at nice 15, under every process of the node at 0 (its own daemons,
    drivers, clients on the host); pdserve's replicas, engine threads included, leave it, and so
    do Serve's proxy and controller (NODE_ENV_VARS): a proxy at 15 beside busy replicas at 0
    was starved, and load through it collapsed after a replica was killed."""
    replicas = {}
    for entry in os.scandir("/proc"):
        try:
            title = open(f"/proc/{entry.name}/cmdline", "rb").read().replace(b"\0", b" ")
        except OSError:  # not a process, or gone
            continue
        if title.startswith((f"ray::ServeReplica:{PD}:".encode(), *SERVE_OWN)):
            replicas[entry.name] = title.decode().split()[0]
    roles = {t.split(":")[4].split(".")[0] for t in replicas.values() if "Replica" in t}
    assert roles == {"Router", "Prefill", "Decode"} and len(replicas) >= 7, replicas
    titles = {t.split(".")[0] for t in replicas.values()}  # "ray::ServeController.method" too
    assert {"ray::ProxyActor", "ray::ServeController"} <= titles, replicas
    for pid, title in replicas.items():
        nice = {t.name: niceness(int(t.name)) for t in os.scandir(f"/proc/{pid}/task")}
        assert set(nice.values()) - {None} == {0}, (title, nice)  # None: a thread that ended
