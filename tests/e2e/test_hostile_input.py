"""Hostile input end to end, through Serve's proxies to the session's apps
(tests/e2e/conftest.py): a request id that is no label, a temperature in float32's underflow,
a tiny repetition penalty, a 4 MB prompt (beside a victim's stream), a message past the proxy's
4 MiB, and over HTTP a 4 MB body, a lone surrogate and a 5,000-digit logit_bias key; each gets
its documented code from the real router, and the app serves on with nothing pinned (no KV
block used or leased, nothing running or waiting). Beside a victim's 120-token greedy stream
(its tokens equal transformers' greedy ones on the same checkpoint, no gap of 1 s): the request
ids, the tiny temperature and penalty, the 4 MB prompt, a client reusing the victim's
request_id and cancelling, and on the router's direct endpoint a PING flood, too many
never-ending streams, and never-ending bodies held open (tests/router/direct/attacker.py, a
process of its own). Missing or wrong API keys: tests/e2e/test_api_keys.py (an app with
keys)."""

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
VICTIM_IDS = (11, 42, 7, 300, 5, 99, 123, 17, 64, 2)  # the victim's prompt
VICTIM_TOKENS = 120
ATTACK_IDS = (3, 1, 4, 1, 5, 9, 2, 6)
RIDS = ("r" * 300, "r" * 10_000, "new\nline")  # no label: too long, or not printable


@pytest.fixture(scope="module")
def victim_oracle(hf, tokenizer_model_dir):
    """Checks a victim's tokens against transformers' greedy `generate` on the app's
    checkpoint, run here once for the module (and cached by the session's oracle)."""
    hf.greedy(tokenizer_model_dir, VICTIM_IDS, VICTIM_TOKENS)
    return lambda got: hf.assert_greedy(tokenizer_model_dir, VICTIM_IDS, got, VICTIM_TOKENS)


def refused(apps, **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        generate(apps, PD, **fields)
    return e.value


def _beside_a_victim(apps, check_victim, attack, request_id: str = "") -> object:
    """Run `attack()` once a victim streams 120 greedy tokens through the proxy (its first
    message arrived; `request_id` its label): the victim's tokens equal transformers' greedy
    ones (`check_victim`), no gap between its messages reaches 1 s, the attack began while
    it streamed, and afterwards nothing is left on any engine replica: no KV block used or
    leased, nothing running or waiting. Returns what the attack returned."""
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=VICTIM_IDS,
        sampling=greedy_sampling(VICTIM_TOKENS),
    )
    streaming = threading.Event()
    got: dict = {"msgs": [], "times": []}

    def victim() -> None:
        for msg in stub(apps).Generate(request, metadata=app_metadata(PD)):
            got["msgs"].append(msg)
            got["times"].append(time.monotonic())
            streaming.set()

    thread = threading.Thread(target=victim)
    thread.start()
    assert streaming.wait(60), "the victim's stream never started"
    beside = thread.is_alive()
    result = attack()
    thread.join(120)
    check_victim(tokens(got["msgs"]))
    gaps = [b - a for a, b in zip(got["times"], got["times"][1:], strict=False)]
    assert max(gaps) < 1.0, max(gaps)
    assert beside, "the victim had finished before the attack began"
    _nothing_left(apps)
    return result


def _nothing_left(apps) -> None:
    """Every engine replica reports no KV block used or leased and nothing running
    (wait_for_idle), and nothing waiting."""
    idle = wait_for_idle(apps, PD, {"prefill", "decode"})
    assert not [r for r in idle if r.kv_blocks_leased or r.waiting], idle


def test_request_ids_that_are_not_labels_are_invalid_argument_beside_a_victim(apps, victim_oracle):
    def attack() -> list[grpc.RpcError]:
        return [
            refused(apps, request_id=rid, prompt="x", sampling=greedy_sampling(2)) for rid in RIDS
        ]

    for e in _beside_a_victim(apps, victim_oracle, attack):
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.details()


def test_a_tiny_temperature_is_greedy_and_a_tiny_penalty_is_refused(
    apps, victim_oracle, hf, tokenizer_model_dir
):
    """Beside a victim's stream (the attacks once made every co-batched request fail)."""

    def attack() -> tuple[list[int], grpc.RpcError]:
        tiny = greedy_sampling(8)
        tiny.temperature = 1e-45  # positive in float32: below the floor, greedy
        got = tokens(generate(apps, PD, prompt_token_ids=ATTACK_IDS, sampling=tiny)[0])
        tiny.temperature, tiny.repetition_penalty = 1.0, 1e-40
        return got, refused(apps, prompt_token_ids=ATTACK_IDS, sampling=tiny)

    got, e = _beside_a_victim(apps, victim_oracle, attack)
    hf.assert_greedy(tokenizer_model_dir, ATTACK_IDS, got, 8)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "repetition_penalty" in e.details()


def test_a_4mb_prompt_is_refused_at_once_and_a_victims_stream_goes_on(apps, victim_oracle):
    def attack() -> tuple[grpc.RpcError, float]:
        start = time.monotonic()
        e = refused(apps, prompt=FOUR_MB, sampling=greedy_sampling(2))
        return e, time.monotonic() - start

    e, took = _beside_a_victim(apps, victim_oracle, attack)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in e.details()
    assert took < 1.0, took


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
    _nothing_left(apps)


def test_a_reused_request_id_and_its_cancel_end_only_the_attackers_call(apps, victim_oracle):
    """A second client sends the victim's request_id and cancels 50 ms later, three times:
    the id is a label, so only the attacker's own calls end."""

    def attack() -> list[grpc.StatusCode]:
        cancelled = []
        for _ in range(3):
            request = pb.GenerateRequest(
                request_id="shared-id", prompt_token_ids=ATTACK_IDS, sampling=greedy_sampling(64)
            )
            call = stub(apps).Generate(request, metadata=app_metadata(PD))
            time.sleep(0.05)
            call.cancel()
            cancelled.append(call.code())
        return cancelled

    cancelled = _beside_a_victim(apps, victim_oracle, attack, request_id="shared-id")
    assert cancelled == [grpc.StatusCode.CANCELLED] * 3


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


def test_a_ping_flood_on_the_direct_endpoint_is_cut_off_beside_a_victim(apps, victim_oracle):
    report = _beside_a_victim(apps, victim_oracle, lambda: _attacker("pings", "100000", timeout=60))
    assert report["goaway"] == 11 and report["debug"] == "too_many_pings", report  # CALM


def test_too_many_never_ending_streams_are_cut_off_beside_a_victim(apps, victim_oracle):
    """Two connections open 300 never-ending calls each, past the 256 streams a connection
    may hold: both connections are closed; the bodies never took an admission slot."""
    report = _beside_a_victim(
        apps, victim_oracle, lambda: _attacker("streams", "2", "300", "4000000", timeout=60)
    )
    assert report is not None and len(report["connections"]) == 2
    assert all(c["goaway"] is not None for c in report["connections"]), report


def test_never_ending_bodies_held_open_do_not_slow_a_victim(apps, victim_oracle):
    """50 calls whose bodies never end, held open for as long as the victim streams (the
    arrival timeout is 30 s): they hold their windows, never a slot, and the victim streams
    on."""
    report = _beside_a_victim(
        apps, victim_oracle, lambda: _attacker("streams", "1", "50", "4000000", timeout=8)
    )
    assert report is None  # still held open when killed: the endpoint did not drop it early
