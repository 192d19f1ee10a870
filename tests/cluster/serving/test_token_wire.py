"""The token stream's frame format: round trips, and every malformed frame refused with
InvalidArgument before anything is built from it."""

from __future__ import annotations

import asyncio
import math

import msgpack
import pytest

from cluster.errors import InvalidArgument
from cluster.request import StepOutput, TokenLogprobs
from cluster.serving.pool_messages import WorkerChunk
from cluster.serving.token_wire import (
    HEADER,
    MAGIC,
    MAX_FRAME_BYTES,
    VERSION,
    _encode_item,
    decode_items,
    encode_frame,
    encode_merged,
    merge_chunks,
    read_frame,
)

KEY = bytes(range(16))


def chunk(**out) -> WorkerChunk:
    fields = dict(request_id="r1", token_ids=(5, 6), text="ab")
    fields.update(out)
    return WorkerChunk(StepOutput(**fields), "replica-1", 0.25, 0.5, 0.75)


async def frames_of(data: bytes) -> list[bytes | None]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    out = []
    while True:
        payload = await read_frame(reader)
        out.append(payload)
        if payload is None:
            return out


def test_round_trip_keeps_every_field():
    scored = chunk(
        finish_reason="length",
        num_prompt_tokens=3,
        num_output_tokens=2,
        queue_seconds=0.125,
        num_cached_tokens=16,
        logprobs=(TokenLogprobs(-0.5, ((5, -0.5), (9, -1.5))), TokenLogprobs(-0.0, ())),
    )
    plain = WorkerChunk(StepOutput("r2", (), ""), "replica-1")
    frame = encode_frame([(KEY, scored), (KEY[::-1], plain)])
    (payload, end) = asyncio.run(frames_of(frame))
    assert end is None
    assert decode_items(payload) == [(KEY, scored), (KEY[::-1], plain)]


def test_frames_follow_each_other_on_one_stream():
    a, b = encode_frame([(KEY, chunk())]), encode_frame([(KEY, chunk(request_id="r9"))])
    payloads = asyncio.run(frames_of(a + b))
    assert [decode_items(p)[0][1].output.request_id for p in payloads[:-1]] == ["r1", "r9"]


@pytest.mark.parametrize(
    "head",
    [
        HEADER.pack(b"XX", VERSION, 4),
        HEADER.pack(MAGIC, VERSION + 1, 4),
        HEADER.pack(MAGIC, VERSION, MAX_FRAME_BYTES + 1),
    ],
    ids=["magic", "version", "too long"],
)
def test_bad_headers_are_refused_before_the_payload_is_read(head):
    with pytest.raises(InvalidArgument):
        asyncio.run(frames_of(head))  # no payload follows: refusing must not wait for it


def test_a_stream_cut_inside_a_frame_is_refused():
    frame = encode_frame([(KEY, chunk())])
    for cut in (3, len(frame) - 1):
        with pytest.raises(InvalidArgument):
            asyncio.run(frames_of(frame[:cut]))


def item(**changes) -> list:
    fields = _encode_item(KEY, chunk(logprobs=(TokenLogprobs(-1.0, ((5, -1.0),)),) * 2))
    names = ["key", "rid", "tokens", "text", "finish", "n_prompt", "n_out", "out_queue",
             "n_cached", "logprobs", "replica", "transfer", "queue", "prefill"]  # fmt: skip
    for name, value in changes.items():
        fields[names.index(name)] = value
    return fields


BAD_ITEMS = {
    "not msgpack": b"\xc1",
    "not an array": msgpack.packb({"a": 1}),
    "item not an array": msgpack.packb([5]),
    "short item": msgpack.packb([item()[:-1]]),
    "short key": msgpack.packb([item(key=b"k" * 15)]),
    "key as str": msgpack.packb([item(key="k" * 16)]),
    "empty request id": msgpack.packb([item(rid="")]),
    "negative token": msgpack.packb([item(tokens=[5, -1])]),
    "bool token": msgpack.packb([item(tokens=[True, 6])]),
    "text not str": msgpack.packb([item(text=b"ab")]),
    "unknown finish": msgpack.packb([item(finish="done")]),
    "negative count": msgpack.packb([item(n_out=-2)]),
    "nan seconds": msgpack.packb([item(transfer=math.nan)]),
    "int seconds": msgpack.packb([item(queue=1)]),
    "logprobs length": msgpack.packb([item(logprobs=[[-1.0, []]])]),
    "nan logprob": msgpack.packb([item(logprobs=[[math.nan, []], [-1.0, []]])]),
    "too many top": msgpack.packb([item(logprobs=[[-1.0, [[1, -1.0]] * 21], [-1.0, []]])]),
    "bad top pair": msgpack.packb([item(logprobs=[[-1.0, [[1]]], [-1.0, []]])]),
    "replica not str": msgpack.packb([item(replica=7)]),
}


@pytest.mark.parametrize("payload", list(BAD_ITEMS.values()), ids=list(BAD_ITEMS))
def test_malformed_items_are_refused(payload):
    with pytest.raises(InvalidArgument):
        decode_items(payload)


def test_the_reference_item_itself_is_accepted():
    ((key, c),) = decode_items(msgpack.packb([item()], use_bin_type=True))
    assert key == KEY and c.output.token_ids == (5, 6) and len(c.output.logprobs) == 2


def test_merged_chunks_keep_every_token_and_the_first_ones_phase_times():
    lp = [TokenLogprobs(-0.1 * i, ((i, -0.1 * i),)) for i in range(3)]
    first = WorkerChunk(
        StepOutput("r1", (1,), "a", None, 7, 1, 0.5, 4, (lp[0],)), "w0", 0.25, 0.125, 0.0625
    )
    second = WorkerChunk(StepOutput("r1", (2,), "b", None, 7, 2, 0.0, 0, (lp[1],)), "w0")
    last = WorkerChunk(StepOutput("r1", (3,), "c", "length", 7, 3, 0.0, 0, (lp[2],)), "w0")
    merged = merge_chunks([first, second, last])
    out = merged.output
    assert (out.token_ids, out.text, out.logprobs) == ((1, 2, 3), "abc", tuple(lp))
    assert (out.finish_reason, out.num_prompt_tokens, out.num_output_tokens) == ("length", 7, 3)
    assert (out.queue_seconds, out.num_cached_tokens) == (0.5, 4)
    assert (merged.kv_transfer_seconds, merged.queue_seconds, merged.prefill_seconds) == (
        0.25,
        0.125,
        0.0625,
    )
    assert merge_chunks([first]) is first


def test_a_backlog_too_big_for_one_frame_is_split_in_order():
    big = "x" * (MAX_FRAME_BYTES // 4)
    chunks = [chunk(token_ids=(i,), text=big) for i in range(6)]
    other = [chunk(request_id="r2", token_ids=(9,), text="y")]
    frames = encode_merged([(KEY, chunks), (bytes(16), other)])
    assert len(frames) > 1 and all(len(f) <= MAX_FRAME_BYTES for f in frames)
    items = [item for f in frames for item in decode_items(f[HEADER.size :])]
    r1 = [t for _, c in items if c.output.request_id == "r1" for t in c.output.token_ids]
    assert r1 == list(range(6))
    assert [c.output.token_ids for _, c in items if c.output.request_id == "r2"] == [(9,)]
