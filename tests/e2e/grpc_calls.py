"""One streaming `Generate` call against the session's apps (tests/e2e/conftest.py), and
what the tests read from its messages."""

from __future__ import annotations

import time

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.ray_fixtures import app_metadata, stub


def generate(ends, app: str, **fields) -> tuple[list[pb.GenerateResponse], list[float]]:
    """One streaming Generate call; returns the messages and their arrival times."""
    sampling = fields.pop("sampling", pb.SamplingParams())
    request = pb.GenerateRequest(sampling=sampling, **fields)
    msgs, times = [], []
    for msg in stub(ends).Generate(request, metadata=app_metadata(app)):
        msgs.append(msg)
        times.append(time.monotonic())
    return msgs, times


def tokens(msgs: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def greedy_sampling(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def replace_seed(s: pb.SamplingParams, seed: int) -> pb.SamplingParams:
    out = pb.SamplingParams()
    out.CopyFrom(s)
    out.seed = seed
    return out
