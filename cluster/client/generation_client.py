"""`GenerationClient`: a blocking client of the public gRPC API (`pdserve.v1.Generation`),
through Serve's gRPC proxy or straight to the routers' own endpoints (`GenerationClient.direct`),
and what the asyncio load generator shares with it: the application metadata Serve's gRPC proxy
routes by and the API key (`authorization: Bearer KEY`, given or `$PDSERVE_API_KEY`), the
routers' endpoints `GetStats` lists, the finish reasons' names, and logprobs in the shared
vocabulary."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence

import grpc

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.request import TokenLogprobs

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


# A cluster's client API key (router.api_keys), sent when no key is given; as the server's.
API_KEY_ENV = "PDSERVE_API_KEY"


def app_metadata(
    application: str | None, api_key: str | None = None
) -> tuple[tuple[str, str], ...]:
    """Serve's gRPC proxy picks the application by the `application` key (needed when a Serve
    instance runs more than one); a cluster with API keys wants `authorization: Bearer KEY`:
    `api_key`, or when it is None `$PDSERVE_API_KEY` ("": send none)."""
    key = os.environ.get(API_KEY_ENV, "").strip() if api_key is None else api_key
    metadata = (("application", application),) if application else ()
    return metadata + ((("authorization", f"Bearer {key}"),) if key else ())


def token_logprobs(msg: pb.GenerateResponse) -> list[TokenLogprobs]:
    """The message's logprobs, one per token id (none unless the request asked)."""
    return [
        TokenLogprobs(lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top_logprobs))
        for lp in msg.logprobs
    ]


def router_endpoints(stats: pb.ClusterStats) -> list[str]:
    """The router replicas' direct gRPC endpoints `stats` lists ("host:port", sorted, each
    once); [] when none does (`router.direct_grpc` off, or a cluster from before them)."""
    return sorted({r.grpc_endpoint for r in stats.replicas if r.grpc_endpoint})


class GenerationClient:
    """`Generate`, `GetModelInfo` and `GetStats` on a Serve gRPC proxy (`target`, host:port),
    for `application` when the Serve instance runs several; or, given several targets (the
    routers' direct endpoints: `direct`), on each in turn, one call each (round robin). Calls
    raise `grpc.RpcError` with the documented status codes. With `tls_ca` (PEM bytes of the
    CA that signed the targets' certificates) the channels are TLS."""

    def __init__(
        self,
        target: str | Sequence[str],
        application: str | None = None,
        api_key: str | None = None,
        tls_ca: bytes | None = None,
    ) -> None:
        self.targets = [target] if isinstance(target, str) else list(target)
        if not self.targets:
            raise ValueError("GenerationClient needs a target")
        if tls_ca is None:
            self.channels = [grpc.insecure_channel(t) for t in self.targets]
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=tls_ca)
            self.channels = [grpc.secure_channel(t, creds) for t in self.targets]
        self.stubs = [pb_grpc.GenerationStub(c) for c in self.channels]
        self._turn = itertools.cycle(self.stubs)
        self.metadata = app_metadata(application, api_key)

    @classmethod
    def direct(
        cls,
        target: str,
        application: str | None = None,
        api_key: str | None = None,
        tls_ca: bytes | None = None,
    ) -> GenerationClient:
        """A client of the routers' own gRPC endpoints, bypassing Serve's proxy (about 2.5x
        less CPU per streamed token; docs/api.md): reads `GetStats` through `target` and
        spreads calls over the endpoints it lists; over `target` itself when none is listed.
        Endpoints of routers that start later are not picked up; make a new client. `tls_ca`:
        the endpoints serve TLS (`router.tls_cert_file`); the proxy at `target` is plaintext."""
        with cls(target, application, api_key) as proxy:
            endpoints = router_endpoints(proxy.stats())
        if not endpoints:
            return cls(target, application, api_key)
        return cls(endpoints, application, api_key, tls_ca)

    def _next(self) -> pb_grpc.GenerationStub:
        """The stub the next call goes to (round robin)."""
        return next(self._turn)

    def generate(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        """The streamed messages; the last one carries finish reason, usage and timing. The
        returned call's `cancel()` cancels the request."""
        return self._next().Generate(request, metadata=self.metadata)

    def model_info(self) -> pb.ModelInfo:
        return self._next().GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def stats(self) -> pb.ClusterStats:
        return self._next().GetStats(pb.GetStatsRequest(), metadata=self.metadata)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
