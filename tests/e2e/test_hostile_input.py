"""Hostile input end to end, through Serve's proxies to the session's apps
(tests/e2e/conftest.py): a request id that is no label, a temperature in float32's underflow,
a tiny repetition penalty, a 4 MB prompt (beside a victim's stream), a message past the proxy's
4 MiB, and over HTTP a 4 MB body, a lone surrogate and a 5,000-digit logit_bias key; each gets
its documented code from the real router, and the app serves on with nothing pinned. Beside a
victim's stream (its tokens exact, no gap of 1 s): a client reusing its request_id and
cancelling, and on the router's direct endpoint a PING flood, too many never-ending streams, and
never-ending bodies held open (tests/router/direct/attacker.py, a process of its own). Missing
or wrong API keys: tests/e2e/test_api_keys.py (an app with keys)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc
import pytest
import requests

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.e2e.conftest import PD
from tests.e2e.grpc_calls import generate, greedy_sampling, tokens
from tests.ray_fixtures import app_metadata, stub, wait_for_idle

FOUR_MB = "x" * 4_000_000


def refused(apps, **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        generate(apps, PD, **fields)
    return e.value


@pytest.mark.parametrize("rid", ["r" * 300, "r" * 10_000, "new\nline"])
def test_a_request_id_that_is_not_a_label_is_invalid_argument(apps, rid):
    e = refused(apps, request_id=rid, prompt="x", sampling=greedy_sampling(2))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.details()


def test_a_tiny_temperature_is_greedy_and_a_tiny_penalty_is_refused(apps):
    """Beside a victim's stream (the attacks once made every co-batched request fail)."""
    want = tokens(generate(apps, PD, prompt="hello there", sampling=greedy_sampling(8))[0])

    def attack() -> tuple[list[int], grpc.RpcError]:
        tiny = greedy_sampling(8)
        tiny.temperature = 1e-45  # positive in float32: below the floor, greedy
        got = tokens(generate(apps, PD, prompt="hello there", sampling=tiny)[0])
        tiny.temperature, tiny.repetition_penalty = 1.0, 1e-40
        return got, refused(apps, prompt="hello there", sampling=tiny)

    got, e = _beside_a_victim(apps, attack)
    assert got == want
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "repetition_penalty" in e.details()


def test_a_4mb_prompt_is_refused_at_once_and_a_victims_stream_goes_on(apps):
    victim = {"prompt": "a victim's stream", "sampling": greedy_sampling(120)}
    want = tokens(generate(apps, PD, **victim)[0])
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(run=generate(apps, PD, **victim)))
    thread.start()
    time.sleep(0.5)  # the victim is streaming
    start = time.monotonic()
    e = refused(apps, prompt=FOUR_MB, sampling=greedy_sampling(2))
    took = time.monotonic() - start
    thread.join(60)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in e.details()
    assert took < 1.0, took
    msgs, times = got["run"]
    assert tokens(msgs) == want
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) < 1.0, max(gaps)
    wait_for_idle(apps, PD, {"prefill", "decode"})


def test_a_message_past_the_proxys_limit_is_resource_exhausted(apps):
    e = refused(apps, prompt="x" * (5 << 20), sampling=greedy_sampling(2))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
    assert len(tokens(generate(apps, PD, prompt="ok", sampling=greedy_sampling(2))[0])) == 2


def test_hostile_openai_bodies_get_their_codes(apps):
    url = f"{apps.http_base}/pd/v1/completions"
    base = {"prompt": "hello there", "max_tokens": 8}
    with requests.Session() as http:
        r = http.post(url, json={**base, "prompt": FOUR_MB}, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        raw = b'{"prompt": "hi \\ud800", "max_tokens": 2}'
        r = http.post(url, data=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = http.post(url, json={**base, "logit_bias": {"9" * 5000: 1}}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        greedy = http.post(url, json={**base, "temperature": 0}, timeout=60)
        tiny = http.post(url, json={**base, "temperature": 1e-40}, timeout=60)
        assert greedy.status_code == tiny.status_code == 200, tiny.text
        assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    wait_for_idle(apps, PD, {"prefill", "decode"})


def _beside_a_victim(apps, attack) -> object:
    """Run `attack()` while a victim streams 120 greedy tokens through the proxy; the victim's
    tokens equal its run alone and no gap between its messages reaches 1 s. Returns what the
    attack returned."""
    victim = {"prompt": "a victim's stream", "sampling": greedy_sampling(120)}
    want = tokens(generate(apps, PD, **victim)[0])
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(run=generate(apps, PD, **victim)))
    thread.start()
    time.sleep(0.5)  # the victim is streaming
    result = attack()
    thread.join(120)
    msgs, times = got["run"]
    assert tokens(msgs) == want
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) < 1.0, max(gaps)
    wait_for_idle(apps, PD, {"prefill", "decode"})
    return result


def test_a_reused_request_id_and_its_cancel_end_only_the_attackers_call(apps):
    """A second client sends the victim's request_id and cancels 50 ms later, three times:
    the id is a label, so only the attacker's own calls end."""
    victim = {"request_id": "shared-id", "prompt": "a victim's stream"}
    want = tokens(generate(apps, PD, **victim, sampling=greedy_sampling(120))[0])
    got: dict = {}

    def run() -> None:
        got.update(run=generate(apps, PD, **victim, sampling=greedy_sampling(120)))

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.3)
    cancelled = []
    for _ in range(3):
        request = pb.GenerateRequest(
            request_id="shared-id", prompt="an attacker's", sampling=greedy_sampling(64)
        )
        call = stub(apps).Generate(request, metadata=app_metadata(PD))
        time.sleep(0.05)
        call.cancel()
        cancelled.append(call.code())
    thread.join(120)
    assert cancelled == [grpc.StatusCode.CANCELLED] * 3
    assert tokens(got["run"][0]) == want
    wait_for_idle(apps, PD, {"prefill", "decode"})


def _attacker(*args: str, timeout: float) -> dict | None:
    """tests/router/direct/attacker.py against the pd app's direct endpoint; its JSON report,
    or None when it was still attacking after `timeout` s (then killed)."""
    from ray import serve

    endpoint = serve.get_deployment_handle("Router", app_name=PD).grpc_endpoint.remote().result()
    cmd = [sys.executable, "-m", "tests.router.direct.attacker", args[0], endpoint, *args[1:]]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.stdout.splitlines()[-1])


def test_a_ping_flood_on_the_direct_endpoint_is_cut_off_beside_a_victim(apps):
    report = _beside_a_victim(apps, lambda: _attacker("pings", "100000", timeout=60))
    assert report["goaway"] == 11 and report["debug"] == "too_many_pings", report  # CALM


def test_too_many_never_ending_streams_are_cut_off_beside_a_victim(apps):
    """Two connections open 300 never-ending calls each, past the 256 streams a connection
    may hold: both connections are closed; the bodies never took an admission slot."""
    report = _beside_a_victim(apps, lambda: _attacker("streams", "2", "300", "4000000", timeout=60))
    assert report is not None and len(report["connections"]) == 2
    assert all(c["goaway"] is not None for c in report["connections"]), report


def test_never_ending_bodies_held_open_do_not_slow_a_victim(apps):
    """50 calls whose bodies never end, held open for as long as the victim streams (the
    arrival timeout is 30 s): they hold their windows, never a slot, and the victim streams
    on."""
    report = _beside_a_victim(apps, lambda: _attacker("streams", "1", "50", "4000000", timeout=8))
    assert report is None  # still held open when killed: the endpoint did not drop it early
