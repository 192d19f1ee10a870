"""The frame format of the token stream: a worker's step outputs, sent to the router.

A frame is a 7-byte header (magic `b"PT"`, version, big-endian payload length) and a msgpack
array of items, one per request that gained tokens in the step. An item is a fixed-position
array (see `_encode_item`): the stream's key, then the fields of a `WorkerChunk`. An item may
carry several steps' tokens: a hop whose next hop has not taken a stream's previous chunk yet
merges the stream's new chunks into one (`merge_chunks`), on both sides of the socket.

The router trusts nothing that comes off the socket: `read_frame` refuses a bad magic or
version and a length over `MAX_FRAME_BYTES` before reading the payload, and `decode_items`
checks every field's type, range and length before building a chunk. A malformed frame raises
`InvalidArgument`; the router then drops that connection. Nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import math
import struct
from typing import NoReturn

import msgpack

from cluster.errors import InvalidArgument
from cluster.request import StepOutput, TokenLogprobs
from cluster.serving.pool_messages import WorkerChunk

MAGIC, VERSION = b"PT", 1
HEADER = struct.Struct(">2sBI")
MAX_FRAME_BYTES = 8 << 20  # a step of 1024 requests with 20 logprobs each is ~1 MiB
KEY_BYTES = 16
MAX_TOP_LOGPROBS = 20
_ITEM_FIELDS = 14
_FINISH = frozenset(("stop", "length", "abort", "prefilled"))
_COUNT_END = 1 << 62  # token ids and counts are below this


def merge_chunks(chunks: list[WorkerChunk]) -> WorkerChunk:
    """Consecutive chunks of one stream as one: their tokens, text and logprobs in order, the
    last one's finish reason and counts, their phase and queue times added up (only a stream's
    first chunk has any) and the most prompt tokens the cache supplied."""
    if len(chunks) == 1:
        return chunks[0]
    first, last = chunks[0].output, chunks[-1].output
    output = StepOutput(
        first.request_id,
        tuple(t for c in chunks for t in c.output.token_ids),
        "".join(c.output.text for c in chunks),
        last.finish_reason,
        last.num_prompt_tokens,
        last.num_output_tokens,
        sum(c.output.queue_seconds for c in chunks),
        max(c.output.num_cached_tokens for c in chunks),
        tuple(lp for c in chunks for lp in c.output.logprobs),
    )
    return WorkerChunk(
        output,
        chunks[-1].replica_id,
        sum(c.kv_transfer_seconds for c in chunks),
        sum(c.queue_seconds for c in chunks),
        sum(c.prefill_seconds for c in chunks),
    )


def encode_frame(items: list[tuple[bytes, WorkerChunk]]) -> bytes:
    """One frame holding `(stream key, chunk)` for each stream that gained output."""
    payload = msgpack.packb([_encode_item(key, c) for key, c in items], use_bin_type=True)
    return HEADER.pack(MAGIC, VERSION, len(payload)) + payload


def encode_merged(streams: list[tuple[bytes, list[WorkerChunk]]]) -> list[bytes]:
    """Frames holding each stream's chunks merged into one item (`merge_chunks`), as few as
    stay under `MAX_FRAME_BYTES` (only a long backlog needs more than one); a stream's
    tokens stay in order across them."""
    frame = encode_frame([(key, merge_chunks(chunks)) for key, chunks in streams])
    if len(frame) <= MAX_FRAME_BYTES or (len(streams) == 1 and len(streams[0][1]) == 1):
        return [frame]
    if len(streams) == 1:
        key, chunks = streams[0]
        half = len(chunks) // 2
        return encode_merged([(key, chunks[:half])]) + encode_merged([(key, chunks[half:])])
    half = len(streams) // 2
    return encode_merged(streams[:half]) + encode_merged(streams[half:])


def _encode_item(key: bytes, c: WorkerChunk) -> list:
    o = c.output
    return [
        key,
        o.request_id,
        list(o.token_ids),
        o.text,
        o.finish_reason,
        o.num_prompt_tokens,
        o.num_output_tokens,
        float(o.queue_seconds),
        o.num_cached_tokens,
        [[float(lp.logprob), [[t, float(p)] for t, p in lp.top]] for lp in o.logprobs],
        c.replica_id,
        float(c.kv_transfer_seconds),
        float(c.queue_seconds),
        float(c.prefill_seconds),
    ]


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's payload, or None at a clean end of stream (between frames)."""
    try:
        head = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise InvalidArgument("token stream ended inside a frame header") from None
    magic, version, length = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise InvalidArgument(f"not a token frame (magic {magic!r}, version {version})")
    if length > MAX_FRAME_BYTES:
        raise InvalidArgument(f"token frame of {length} bytes is over {MAX_FRAME_BYTES}")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise InvalidArgument("token stream ended inside a frame") from None


def decode_items(payload: bytes) -> list[tuple[bytes, WorkerChunk]]:
    """Parse and check a frame's payload into `(stream key, chunk)` pairs."""
    try:
        items = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several types for malformed input
        raise InvalidArgument(f"token frame is not msgpack: {type(e).__name__}") from None
    if not isinstance(items, list):
        raise InvalidArgument("token frame must be an array of items")
    return [_decode_item(item) for item in items]


def _decode_item(item) -> tuple[bytes, WorkerChunk]:
    """One item, every field checked. Runs for every token the router relays, so the checks
    are written out (exact types: msgpack gives int, float, str, bytes, list, None) rather
    than through helpers."""
    if type(item) is not list or len(item) != _ITEM_FIELDS:
        raise InvalidArgument(f"token item must be an array of {_ITEM_FIELDS} fields")
    (key, rid, token_ids, text, finish, n_prompt, n_out, out_queue, n_cached, logprobs,
     replica_id, transfer_s, queue_s, prefill_s) = item  # fmt: skip
    if type(key) is not bytes or len(key) != KEY_BYTES:
        raise InvalidArgument("token item key must be 16 bytes")
    if type(rid) is not str or not 0 < len(rid) <= 256:
        _bad("request_id")
    if type(token_ids) is not list:
        _bad("token_ids")
    for t in token_ids:
        if type(t) is not int or not 0 <= t < _COUNT_END:
            _bad("token_ids")
    if type(text) is not str:
        _bad("text")
    if finish is not None and (type(finish) is not str or finish not in _FINISH):
        _bad("finish_reason")
    for n in (n_prompt, n_out, n_cached):
        if type(n) is not int or not 0 <= n < _COUNT_END:
            _bad("token counts")
    for x in (out_queue, transfer_s, queue_s, prefill_s):
        if type(x) is not float or not 0.0 <= x < math.inf:  # NaN fails both
            _bad("seconds")
    if type(replica_id) is not str or len(replica_id) > 256:
        _bad("replica_id")
    if type(logprobs) is not list or len(logprobs) not in (0, len(token_ids)):
        _bad("logprobs")
    output = StepOutput(
        rid,
        tuple(token_ids),
        text,
        finish,
        n_prompt,
        n_out,
        out_queue,
        n_cached,
        tuple(_decode_logprobs(lp) for lp in logprobs) if logprobs else (),
    )
    return key, WorkerChunk(output, replica_id, transfer_s, queue_s, prefill_s)


def _decode_logprobs(lp) -> TokenLogprobs:
    ok = isinstance(lp, list) and len(lp) == 2 and _is_logprob(lp[0]) and isinstance(lp[1], list)
    _check(ok and len(lp[1]) <= MAX_TOP_LOGPROBS, "logprobs entry")
    top = lp[1]
    _check(
        all(
            isinstance(t, list) and len(t) == 2 and _is_count(t[0]) and _is_logprob(t[1])
            for t in top
        ),
        "top logprobs",
    )
    return TokenLogprobs(lp[0], tuple((t[0], t[1]) for t in top))


def _check(ok: bool, what: str) -> None:
    if not ok:
        _bad(what)


def _bad(what: str) -> NoReturn:
    raise InvalidArgument(f"token item has a bad {what}")


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _COUNT_END


def _is_logprob(x) -> bool:
    return isinstance(x, float) and not math.isnan(x)
