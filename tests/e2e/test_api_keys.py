"""API keys end to end: an app of this module's own ("keyed", disaggregated) with one key in
`router.api_keys` and another in `router.api_key_file`, its routers' direct endpoints over
TLS. Every entry point (Serve's gRPC proxy, a router's direct endpoint, Serve's HTTP proxy)
refuses a call without a key or with a wrong one (UNAUTHENTICATED / 401), `GetStats`
included; with a key, tokens equal transformers' greedy ones and the official `openai` client
works with `api_key=`. Hostile callers without the key do not disturb a keyed victim's stream.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import grpc
import openai
import pytest
import requests

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.serving.app_config import RouterConfig
from tests.e2e.grpc_calls import greedy_sampling, tokens
from tests.ray_fixtures import deploy, small_app_config
from tests.tls_cert import self_signed

pytestmark = pytest.mark.slow

APP = "keyed"
KEY = "sk-e2e-inline-0123456789"
FILE_KEY = "sk-e2e-file-9876543210"
PROMPT_IDS = (11, 42, 7, 300, 5, 99, 123, 17)
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def keyed(ray_serve, tokenizer_model_dir, tmp_path_factory):
    from ray import serve

    out = tmp_path_factory.mktemp("keyed")
    cert, key = self_signed(out)
    keyfile = out / "keys"
    keyfile.write_text(f"# the e2e test's second key\n{FILE_KEY}\n")
    base = small_app_config(str(tokenizer_model_dir))
    router = RouterConfig(
        num_cpus=0.25,
        api_keys=(KEY,),
        api_key_file=str(keyfile),
        tls_cert_file=str(cert),
        tls_key_file=str(key),
    )
    deploy(replace(base, router=router), APP, f"/{APP}")
    yield ray_serve, cert.read_bytes()
    serve.delete(APP)


def metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    auth = (("authorization", f"Bearer {key}"),) if key is not None else ()
    return (("application", APP), *auth)


def proxy_stub(ends) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(ends.grpc_target))


def direct_stub(ends, cert: bytes) -> pb_grpc.GenerationStub:
    stats = proxy_stub(ends).GetStats(pb.GetStatsRequest(), metadata=metadata(KEY))
    (endpoint,) = {r.grpc_endpoint for r in stats.replicas if r.grpc_endpoint}
    creds = grpc.ssl_channel_credentials(root_certificates=cert)
    return pb_grpc.GenerationStub(grpc.secure_channel(endpoint, creds))


def greedy_request(n: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=PROMPT_IDS, sampling=greedy_sampling(n))


def refusals(stub: pb_grpc.GenerationStub, key: str | None) -> list[grpc.StatusCode]:
    """Each method's status, called with `key` (None: no authorization metadata)."""
    calls = (
        lambda: list(stub.Generate(greedy_request(4), metadata=metadata(key), timeout=30)),
        lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata(key), timeout=30),
        lambda: stub.GetStats(pb.GetStatsRequest(), metadata=metadata(key), timeout=30),
    )
    codes = []
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        codes.append(e.value.code())
        assert KEY not in (e.value.details() or "")
    return codes


def wait_idle(ends, timeout_s: float = 20.0) -> None:
    """Until every engine replica reports no KV block used or leased (GetStats, with a key)."""
    deadline = time.monotonic() + timeout_s
    time.sleep(1.3)  # past a replica's report interval: no answer from before the calls
    while True:
        stats = proxy_stub(ends).GetStats(pb.GetStatsRequest(), metadata=metadata(KEY))
        engines = [r for r in stats.replicas if r.pool in ("prefill", "decode")]
        busy = [r for r in engines if r.kv_blocks_used or r.kv_blocks_leased or r.running]
        if len(engines) == 2 and not busy:
            return
        assert time.monotonic() < deadline, f"KV not back to zero: {engines}"
        time.sleep(0.2)


def test_grpc_proxy_refuses_without_the_key_and_serves_with_it(keyed, hf, tokenizer_model_dir):
    ends, _ = keyed
    stub = proxy_stub(ends)
    for key in (None, "sk-wrong", KEY + "x"):
        assert refusals(stub, key) == [UNAUTHENTICATED] * 3, key
    for key in (KEY, FILE_KEY):
        msgs = list(stub.Generate(greedy_request(12), metadata=metadata(key)))
        hf.assert_greedy(tokenizer_model_dir, PROMPT_IDS, tokens(msgs), 12)
    stats = stub.GetStats(pb.GetStatsRequest(), metadata=metadata(KEY))
    assert {r.pool for r in stats.replicas} >= {"router", "prefill", "decode"}
    wait_idle(ends)


def test_direct_endpoint_over_tls_refuses_without_the_key(keyed, hf, tokenizer_model_dir):
    ends, cert = keyed
    stub = direct_stub(ends, cert)
    for key in (None, "sk-wrong"):
        assert refusals(stub, key) == [UNAUTHENTICATED] * 3, key
    msgs = list(stub.Generate(greedy_request(12), metadata=metadata(FILE_KEY)))
    hf.assert_greedy(tokenizer_model_dir, PROMPT_IDS, tokens(msgs), 12)
    assert stub.GetStats(pb.GetStatsRequest(), metadata=metadata(KEY)).replicas
    wait_idle(ends)


def test_http_refuses_without_the_key_and_the_openai_client_works_with_it(keyed):
    ends, _ = keyed
    base = f"{ends.http_base}/{APP}/v1"
    bodies = {
        "completions": {"prompt": list(PROMPT_IDS), "max_tokens": 4},
        "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    }
    with requests.Session() as http:
        for path, body in bodies.items():
            for headers in ({}, {"authorization": "Bearer sk-wrong"}):
                r = http.post(f"{base}/{path}", json=body, headers=headers, timeout=30)
                assert r.status_code == 401, (path, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert http.get(f"{base}/models", timeout=30).status_code == 401
        assert http.get(f"{ends.http_base}/{APP}/health", timeout=30).status_code == 200
    want = list(proxy_stub(ends).Generate(greedy_request(8), metadata=metadata(KEY)))
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    done = client.completions.create(
        model="", prompt=list(PROMPT_IDS), max_tokens=8, temperature=0.0
    )
    assert done.choices[0].text == "".join(m.text for m in want)
    chat = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0
    )
    assert chat.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0).completions.create(
            model="", prompt="hi", max_tokens=2
        )
    wait_idle(ends)


def test_callers_without_a_key_do_not_disturb_a_victims_stream(keyed, hf, tokenizer_model_dir):
    """Hostile: missing and wrong keys at every entry point, 20 rounds, while a keyed victim
    streams 240 tokens; every refusal is UNAUTHENTICATED / 401 and quick, and the victim's
    tokens equal transformers'."""
    ends, cert = keyed
    got: dict = {}

    def victim() -> None:
        msgs = list(proxy_stub(ends).Generate(greedy_request(240), metadata=metadata(KEY)))
        got["tokens"] = tokens(msgs)

    thread = threading.Thread(target=victim)
    thread.start()
    proxy, direct = proxy_stub(ends), direct_stub(ends, cert)
    slowest, beside_victim = 0.0, 0
    with requests.Session() as http:
        for round_ in range(20):
            beside_victim += thread.is_alive()
            key = None if round_ % 2 else f"sk-guess-{round_}"
            start = time.monotonic()
            assert refusals(proxy, key) == [UNAUTHENTICATED] * 3
            assert refusals(direct, key) == [UNAUTHENTICATED] * 3
            headers = {"authorization": f"Bearer {key}"} if key else {}
            r = http.post(
                f"{ends.http_base}/{APP}/v1/completions",
                json={"prompt": "x" * 100_000, "max_tokens": 64},
                headers=headers,
                timeout=30,
            )
            assert r.status_code == 401
            slowest = max(slowest, (time.monotonic() - start) / 7)
    thread.join(120)
    hf.assert_greedy(tokenizer_model_dir, PROMPT_IDS, got["tokens"], 240)
    assert slowest < 1.0, slowest
    assert beside_victim >= 1  # the refusals ran while the victim streamed
    wait_idle(ends)
