"""A small client for the public gRPC API, used by `pdserve generate` and `pdserve status`."""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.request import TokenLogprobs

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


def connect(target: str) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(target))


def app_metadata(application: str | None) -> tuple[tuple[str, str], ...]:
    """Serve's gRPC proxy picks the application by this metadata key (needed when a Serve
    instance runs more than one)."""
    return (("application", application),) if application else ()


def generate_remote(args: argparse.Namespace, token_ids: list[int] | None) -> int:
    sampling = pb.SamplingParams(
        top_k=args.top_k,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    for name in ("max_tokens", "temperature", "top_p", "seed", "logprobs"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    request = pb.GenerateRequest(sampling=sampling)
    if token_ids is not None:
        request.prompt_token_ids.extend(token_ids)
    else:
        request.prompt = args.prompt
    ids: list[int] = []
    text = []
    scored: list[TokenLogprobs] = []
    last = None
    try:
        stub = connect(args.target)
        for msg in stub.Generate(request, metadata=app_metadata(args.application)):
            ids.extend(msg.token_ids)
            text.append(msg.text)
            scored.extend(
                TokenLogprobs(lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top_logprobs))
                for lp in msg.logprobs
            )
            last = msg
            if not args.json:
                print(msg.text, end="", flush=True)
    except grpc.RpcError as e:
        print(f"\nerror ({e.code().name}): {e.details()}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {
                    "request_id": last.request_id,
                    "token_ids": ids,
                    "text": "".join(text),
                    "finish_reason": FINISH_REASONS.get(last.finish_reason, ""),
                    "usage": MessageToDict(last.usage, preserving_proto_field_name=True),
                    "timing": MessageToDict(last.timing, preserving_proto_field_name=True),
                    **logprobs_json(ids, scored, args.logprobs),
                }
            )
        )
    else:
        print()
    return 0


def logprobs_json(token_ids: list[int], logprobs: list[TokenLogprobs], asked: int | None) -> dict:
    """`generate --json`'s "logprobs" entry (absent unless --logprobs was given): per token,
    its id, logprob and the most likely alternatives."""
    if asked is None:
        return {}
    return {
        "logprobs": [
            {
                "token_id": token,
                "logprob": lp.logprob,
                "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top],
            }
            for token, lp in zip(token_ids, logprobs, strict=True)
        ]
    }


def print_status(target: str, application: str | None = None) -> int:
    stub = connect(target)
    metadata = app_metadata(application)
    try:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
        stats = stub.GetStats(pb.GetStatsRequest(), metadata=metadata)
    except grpc.RpcError as e:
        print(f"error ({e.code().name}): {e.details()}", file=sys.stderr)
        return 2
    print(f"model {info.model_id}  mode {info.mode}  block_size {info.block_size}\n")
    _table(
        ("pool", "deployment", "replicas", "target", "min..max", "load (total / target each)"),
        [
            (
                p.pool,
                p.deployment,
                p.current_replicas,
                p.target_replicas,
                f"{p.min_replicas}..{p.max_replicas}",
                ", ".join(f"{g.name} {g.value:g} / {g.target_per_replica:g}" for g in p.signals),
            )
            for p in stats.pools
        ],
    )
    print()
    header = (
        "pool",
        "replica",
        "kv total",
        "kv used",
        "kv leased",
        "kv cached",
        "running",
        "waiting",
        "queued",
        "generated",
    )
    rows = [
        (
            r.pool,
            r.replica_id,
            r.kv_blocks_total,
            r.kv_blocks_used,
            r.kv_blocks_leased,
            r.kv_blocks_cached,
            r.running,
            r.waiting,
            r.queued_prompt_tokens,
            r.generated_tokens,
        )
        for r in stats.replicas
    ]
    _table(header, rows)
    return 0


def _table(header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))
