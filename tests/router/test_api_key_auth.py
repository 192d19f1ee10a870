"""The router's API key check (router/api_key_auth.py) at both doors, over a generation
service double: the router's own gRPC methods on its direct endpoint (grpc.aio clients,
plaintext and TLS) and the OpenAI routes behind `ApiKeyAuth` (raw HTTP and the official
`openai` client). Without the key nothing is generated; with it everything works."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.serving.api_keys import ApiKey, ApiKeys
from router.api_key_auth import ApiKeyAuth, authorization
from router.direct import Admission, GrpcServer, service_methods
from router.direct_tls import direct_tls
from router.openai_api import install_error_handlers, openai_routes
from router.openai_tokenize import tokenizer_routes
from router.pool_status import ClusterStats
from router.router import GENERATION, Router
from tests.router.direct.rig import request
from tests.router.fake_service import FakeService
from tests.tls_cert import self_signed

KEY = "sk-test-0123456789abcdef"
KEYS = ApiKeys([ApiKey(KEY)])


class StatsService(FakeService):
    async def stats(self) -> ClusterStats:
        return ClusterStats((), (), "grpc")


class KeyedServicer:
    """The router's three methods, keys and all, over a generation service."""

    Generate = Router.Generate
    GetModelInfo = Router.GetModelInfo
    GetStats = Router.GetStats

    def __init__(self, service: FakeService, keys: ApiKeys) -> None:
        self.orch = service
        self.keys = keys
        self.admission = Admission(1024, 4096)


@asynccontextmanager
async def endpoint(fake: FakeService, tls=None):
    server = GrpcServer("127.0.0.1")
    await server.start(service_methods(GENERATION, KeyedServicer(fake, KEYS)), ssl=tls)
    try:
        yield server.endpoint
    finally:
        await server.stop(1.0)


async def every_method(stub, metadata) -> list[grpc.StatusCode]:
    """Each method's status when called with `metadata`."""
    calls = (
        lambda: stub.Generate(request(3), metadata=metadata).read(),
        lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata),
        lambda: stub.GetStats(pb.GetStatsRequest(), metadata=metadata),
    )
    codes = []
    for call in calls:
        try:
            await call()
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as e:
            codes.append(e.code())
            assert KEY not in (e.details() or "")
    return codes


REFUSED = [
    None,
    (("authorization", "Bearer sk-wrong"),),
    (("authorization", KEY),),  # no scheme
    (("x-api-key", KEY),),
]


def test_direct_endpoint_refuses_every_method_without_the_key():
    async def go():
        fake = StatsService()
        async with endpoint(fake) as target:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = pb_grpc.GenerationStub(channel)
                refused = [await every_method(stub, m) for m in REFUSED]
                ok = [m async for m in stub.Generate(request(4), metadata=bearer())]
                stats = await stub.GetStats(pb.GetStatsRequest(), metadata=bearer())
        return fake, refused, ok, stats

    fake, refused, ok, stats = asyncio.run(go())
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    assert refused == [[unauthenticated] * 3] * len(REFUSED)
    assert [m.text for m in ok] == [" t0", " t1", " t2", " t3"]
    assert stats.kv_transport == "grpc"
    assert fake.opened == 1 == fake.closed  # nothing started for a refused call


def bearer(key: str = KEY) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


def test_direct_endpoint_over_tls_with_the_key(tls_files):
    cert, key = tls_files

    async def go():
        fake = StatsService()
        async with endpoint(fake, direct_tls(str(cert), str(key))) as target:
            creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            async with grpc.aio.secure_channel(target, creds) as channel:
                stub = pb_grpc.GenerationStub(channel)
                refused = await every_method(stub, None)
                ok = [m async for m in stub.Generate(request(3), metadata=bearer())]
            async with grpc.aio.insecure_channel(target) as plain:  # plaintext to a TLS port
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await pb_grpc.GenerationStub(plain).GetModelInfo(
                        pb.GetModelInfoRequest(), metadata=bearer(), timeout=5
                    )
        return fake, refused, ok, e.value.code()

    fake, refused, ok, plaintext = asyncio.run(go())
    assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert [m.text for m in ok] == [" t0", " t1", " t2"]
    assert plaintext == grpc.StatusCode.UNAVAILABLE
    assert fake.opened == fake.closed == 1


def test_tls_files_that_do_not_load_are_refused(tmp_path):
    (tmp_path / "cert.pem").write_text("not a certificate")
    with pytest.raises(Exception, match="tls_cert_file"):
        direct_tls(str(tmp_path / "cert.pem"), str(tmp_path / "cert.pem"))
    assert direct_tls("", "") is None


def test_metadata_read_from_both_kinds_of_context():
    class Served:  # grpc's and Serve's contexts
        def invocation_metadata(self):
            return [("x", "1"), ("authorization", "Bearer a")]

    class Direct:  # router.direct.GrpcCall
        headers = {b":path": b"/x", b"authorization": b"Bearer b"}

    assert authorization(Served()) == "Bearer a"
    assert authorization(Direct()) == b"Bearer b"


@pytest.fixture
def keyed_client(fake: FakeService):
    app = FastAPI()
    app.include_router(openai_routes(lambda: fake))
    app.include_router(tokenizer_routes(lambda: fake))
    install_error_handlers(app)
    app.add_middleware(ApiKeyAuth, keys=KEYS)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
    assert fake.closed == fake.opened


ROUTES = [
    ("post", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("get", "/v1/models", None),
    ("get", "/v1/models/tiny-llama", None),
    ("post", "/tokenize", {"prompt": "hi"}),
    ("post", "/detokenize", {"tokens": [1]}),
]


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-wrong"}, {"api-key": KEY}])
def test_http_routes_answer_401_without_the_key(keyed_client, fake, headers):
    for method, path, body in ROUTES:
        r = keyed_client.request(method, path, json=body, headers=headers)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert KEY not in r.text
    assert fake.opened == 0
    assert keyed_client.get("/health").status_code == 200  # the probe stays open


def test_the_open_probe_under_a_route_prefix(fake):
    app = FastAPI()
    app.include_router(openai_routes(lambda: fake))
    app.add_middleware(ApiKeyAuth, keys=KEYS)
    with TestClient(app, root_path="/pd") as client:
        assert client.get("/pd/health").status_code == 200
        assert client.get("/pd/v1/models").status_code == 401


def test_openai_client_works_with_the_key_and_not_without(keyed_client, fake):
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url="http://testserver/v1", api_key=key, http_client=keyed_client, max_retries=0
        )

    done = client(KEY).completions.create(model="tiny-llama", prompt="hi", max_tokens=3)
    assert done.choices[0].text == " t0 t1 t2"
    chat = client(KEY).chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        client("sk-wrong").completions.create(model="tiny-llama", prompt="hi", max_tokens=3)
    assert fake.opened == 2


def test_generation_client_with_a_key_over_tls(tls_files, monkeypatch):
    """pdserve's own blocking client (`GenerationClient`, as `pdserve generate --direct
    --direct-tls-ca` makes it) against the keyed TLS endpoint: the key given, or from
    `$PDSERVE_API_KEY`; none, refused."""
    from cluster.client.generation_client import API_KEY_ENV, GenerationClient

    cert, key = tls_files
    monkeypatch.delenv(API_KEY_ENV, raising=False)

    def calls(target: str) -> list:
        out = []
        with GenerationClient(target, api_key=KEY, tls_ca=cert.read_bytes()) as client:
            out.append([m.text for m in client.generate(request(2))])
        monkeypatch.setenv(API_KEY_ENV, KEY)
        with GenerationClient(target, tls_ca=cert.read_bytes()) as client:
            out.append(client.stats().kv_transport)
        monkeypatch.delenv(API_KEY_ENV)
        with GenerationClient(target, tls_ca=cert.read_bytes()) as client:
            try:
                client.model_info()
            except grpc.RpcError as e:
                out.append(e.code())
        return out

    async def go():
        fake = StatsService()
        async with endpoint(fake, direct_tls(str(cert), str(key))) as target:
            return await asyncio.to_thread(calls, target)

    assert asyncio.run(go()) == [[" t0", " t1"], "grpc", grpc.StatusCode.UNAUTHENTICATED]
