"""`GenerationClient`: a blocking client of the public gRPC API (`pdserve.v1.Generation`), and
what the asyncio load generator shares with it: the application metadata Serve's gRPC proxy
routes by, the finish reasons' names, and logprobs in the shared vocabulary."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.request import TokenLogprobs

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


def app_metadata(application: str | None) -> tuple[tuple[str, str], ...]:
    """Serve's gRPC proxy picks the application by this metadata key (needed when a Serve
    instance runs more than one)."""
    return (("application", application),) if application else ()


def token_logprobs(msg: pb.GenerateResponse) -> list[TokenLogprobs]:
    """The message's logprobs, one per token id (none unless the request asked)."""
    return [
        TokenLogprobs(lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top_logprobs))
        for lp in msg.logprobs
    ]


class GenerationClient:
    """`Generate`, `GetModelInfo` and `GetStats` on one Serve gRPC proxy (`target`, host:port),
    for `application` when the Serve instance runs several. Calls raise `grpc.RpcError` with
    the documented status codes."""

    def __init__(self, target: str, application: str | None = None) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = app_metadata(application)

    def generate(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        """The streamed messages; the last one carries finish reason, usage and timing. The
        returned call's `cancel()` cancels the request."""
        return self.stub.Generate(request, metadata=self.metadata)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def stats(self) -> pb.ClusterStats:
        return self.stub.GetStats(pb.GetStatsRequest(), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
