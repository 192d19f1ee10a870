"""Writes the seed corpus of the fuzz tests (tests/fuzz/corpus/): small valid encodings of
each decoder's input, built by the encoders themselves. Run `python -m tests.fuzz.make_corpus`
after a wire format changes and commit the result; each fuzz module checks that its seeds still
decode."""

from __future__ import annotations

import json

import torch

from cluster.engine.kv_cache import KVLayout
from cluster.kv_transfer import kv_frame
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.kv_transfer.kv_wire import encode_chunks
from cluster.pb.pdserve.v1 import generation_pb2 as gpb
from cluster.request import StepOutput, TokenLogprobs
from cluster.serving import token_wire
from cluster.serving.pool_messages import WorkerChunk
from tests.fuzz.fuzzing import CORPUS

LAYOUT = KVLayout("fuzz-model@1", "float32", 2, 2, 4, 2)  # 2 layers, 2 heads, dim 4, block 2
SECRET = b"fuzz-secret"
KEY = bytes(range(16))


def token_frames() -> list[bytes]:
    lp = (TokenLogprobs(-0.5, ((3, -0.5), (9, -1.25))), TokenLogprobs(-2.0, ()))
    chunks = [
        WorkerChunk(StepOutput("r1", (1, 2), "ab"), "decode-0"),
        WorkerChunk(
            StepOutput("r2", (7, 8), "héllo", "stop", 5, 2, 0.25, 3, lp), "decode-1", 0.1, 0.2, 0.3
        ),
        WorkerChunk(StepOutput("r3", (), "", "prefilled", 4, 0), ""),
    ]
    return [
        token_wire.encode_frame([(KEY, chunks[0])]),
        token_wire.encode_frame([(KEY, c) for c in chunks]),
        token_wire.encode_frame([]),
    ]


def kv_tensors(num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (LAYOUT.num_layers, num_blocks, *LAYOUT.block_shape)
    k = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    return k, -k


def kv_chunks() -> list[bytes]:
    """KVChunk messages (wire form) of a 3-block handle, in chunks of one and two layers."""
    k, v = kv_tensors(3)
    out = [kv_frame.encode_frame(h, d) for h, d in encode_chunks(k, v, 256)]
    out += [kv_frame.encode_frame(h, d) for h, d in encode_chunks(k, v, 1 << 20)]
    return out


def kv_handle(rid: str, block_ids: tuple[int, ...], num_tokens: int) -> KVHandle:
    return KVHandle(
        request_id=rid,
        num_tokens=num_tokens,
        endpoint="10.0.0.7:7401",
        transport="nixl",
        block_ids=block_ids,
        block_size=LAYOUT.block_size,
        layout=LAYOUT,
        lease_expiry_unix=1.8e9,
        capability_token=Capability(SECRET).token(rid, block_ids),
        first_token_id=42,
    )


def kv_handles() -> list[bytes]:
    handles = [kv_handle("r1", (0, 1, 2), 5), kv_handle("r-ü", (9,), 1)]
    return [h.to_proto().SerializeToString() for h in handles]


def generate_requests() -> list[bytes]:
    sampling = gpb.SamplingParams(
        max_tokens=4, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["\n"], logprobs=2
    )
    sampling.stop_token_ids.append(2)
    sampling.logit_bias[7] = -1.5
    msgs = [
        gpb.GenerateRequest(prompt="Hello there", sampling=sampling, request_id="client-1"),
        gpb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=gpb.SamplingParams()),
        gpb.GenerateRequest(prompt="x", stream_interval=2),
    ]
    return [m.SerializeToString() for m in msgs]


def openai_bodies() -> dict[str, dict]:
    return {
        "openai_completion_0.json": {"model": "tiny", "prompt": "Hello", "max_tokens": 3},
        "openai_completion_1.json": {
            "prompt": [5, 6, 7],
            "max_tokens": 2,
            "temperature": 0.5,
            "stop": ["x"],
            "logprobs": 2,
            "seed": 1,
            "stream": True,
        },
        "openai_chat_0.json": {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
            ],
            "max_tokens": 2,
        },
        "openai_chat_1.json": {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hey"}]}],
            "max_completion_tokens": 3,
            "top_p": 0.9,
            "logprobs": True,
            "top_logprobs": 2,
        },
    }


def main() -> None:
    CORPUS.mkdir(exist_ok=True)
    for stale in CORPUS.iterdir():
        stale.unlink()
    for prefix, items in (
        ("token_frame", token_frames()),
        ("kv_chunk", kv_chunks()),
        ("kv_handle", kv_handles()),
        ("generate_request", generate_requests()),
    ):
        for i, data in enumerate(items):
            (CORPUS / f"{prefix}_{i}.bin").write_bytes(data)
    for name, body in openai_bodies().items():
        (CORPUS / name).write_text(json.dumps(body, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
