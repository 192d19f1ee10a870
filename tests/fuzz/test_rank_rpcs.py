"""Fuzzing the KV RPCs of tensor-parallel replicas over real gRPC, with hostile bytes as any
peer on the cluster network could send them: `PinKV` (a prefill replica's rank 0 `KVServer`),
`FetchKV` of a head slice (a prefill rank 1's `RankServer`) and `ImportKV` (a decode rank 1's
`RankServer`), against a live TP 2 prefill and TP 2 decode replica (`tests/tp_pairs.py`).

Whatever the bytes, each call either is what a genuine peer gets (the lease pinned, the KV of
the lease) or ends with a documented status (INVALID_ARGUMENT, UNAUTHENTICATED, NOT_FOUND,
FAILED_PRECONDITION, RESOURCE_EXHAUSTED; UNKNOWN only for bytes that are not the message at
all, which grpc.aio refuses before any handler runs); the servers keep serving, a genuine move
still works afterwards, and every lease and block is back to zero at the end."""

from __future__ import annotations

import asyncio
import threading
from contextlib import ExitStack
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from cluster.kv_transfer.grpc.tp_ranks import source_layout
from cluster.kv_transfer.kv_frame import decode_frame
from cluster.kv_transfer.kv_handle import KVHandle, layout_to_proto
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from tests.conftest import build_checkpoint, prompt
from tests.fuzz.fuzzing import fuzz, mutated
from tests.tp_pairs import tp_pairs

DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# What grpc.aio answers, before any handler runs, for bytes that do not parse as the request.
NOT_THE_MESSAGE = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
METHOD = "/pdserve.v1.KVTransfer/"
RID = "fuzz-lease"


@dataclass
class Live:
    pairs: object
    handle: KVHandle
    run: object  # run a coroutine on the harness's loop, wait for its result
    channels: dict

    def call(self, endpoint: str, method: str, raw: bytes, stream: bool):
        channel = self.channels.setdefault(endpoint, grpc.insecure_channel(endpoint))
        if stream:
            return channel.unary_stream(METHOD + method)(raw, timeout=10)
        return channel.unary_unary(METHOD + method)(raw, timeout=10)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    checkpoint = build_checkpoint("llama-gqa", tmp_path_factory.mktemp("fuzz-tp"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-tp-loop", daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    with ExitStack() as stack:
        harness = tp_pairs(checkpoint, stack, num_blocks=32, pairs=[(2, 2)])
        p = run(harness.__aenter__())
        try:
            handle = run(p.handle(2, RID, prompt(9, seed=3)))
            state = Live(p, handle, run, {})
            yield state
            for channel in state.channels.values():
                channel.close()
            run(p.move((2, 2), "after-fuzz", prompt(11, seed=4)))  # still serving
            assert run(p.client[2].release(handle, "aborted"))
        except BaseException as exc:
            run(harness.__aexit__(type(exc), exc, exc.__traceback__))
            raise
        else:
            run(harness.__aexit__(None, None, None))  # every lease ended, every block free
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


def _refused_as_documented(exc: grpc.RpcError, raw: bytes, message) -> None:
    code = exc.code()
    if code in NOT_THE_MESSAGE:
        with pytest.raises(DecodeError):  # only bytes that are not the message at all
            message.FromString(raw)
        return
    assert code in DOCUMENTED, (code, exc.details())
    assert exc.details(), code


def _pin_seed(live: Live) -> bytes:
    h = live.handle
    return pb.PinKVRequest(request_id=h.request_id, capability_token=h.capability_token)


def _fetch_seed(live: Live) -> pb.FetchKVRequest:
    heads = source_layout(live.handle, 1)  # rank 1's heads, as a decode rank asks for them
    return pb.FetchKVRequest(handle=live.handle.to_proto(), receiver_layout=layout_to_proto(heads))


def _import_seed(live: Live) -> pb.ImportKVRequest:
    # Not this replica's secret: a peer that is not rank 0 (mutations rarely make it genuine).
    return pb.ImportKVRequest(
        handle=live.handle.to_proto(),
        block_ids=list(range(len(live.handle.block_ids))),
        replica_secret=b"not the replica's secret",
    )


def test_the_unmutated_requests_pin_and_fetch_and_a_foreign_import_is_refused(live):
    pin = live.call(live.pairs.endpoints[2][0], "PinKV", _pin_seed(live).SerializeToString(), True)
    assert tuple(pb.KVPinned.FromString(next(pin)).block_ids) == live.handle.block_ids
    pin.cancel()
    fetch = _fetch_seed(live).SerializeToString()
    assert list(live.call(live.pairs.endpoints[2][1][0], "FetchKV", fetch, stream=True))
    with pytest.raises(grpc.RpcError) as refused:
        raw = _import_seed(live).SerializeToString()
        live.call(live.pairs.client[2].ranks[0], "ImportKV", raw, stream=False)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


@fuzz(150)
@given(data=st.data())
def test_hostile_pin_requests_to_rank_0(live, data):
    raw = data.draw(mutated(st.just(_pin_seed(live).SerializeToString())) | st.binary(max_size=80))
    call = live.call(live.pairs.endpoints[2][0], "PinKV", raw, stream=True)
    try:
        pinned = pb.KVPinned.FromString(next(call))
    except grpc.RpcError as exc:
        _refused_as_documented(exc, raw, pb.PinKVRequest)
        return
    finally:
        call.cancel()
    assert tuple(pinned.block_ids) == live.handle.block_ids  # genuine: its own lease only
    assert pinned.num_tokens == live.handle.num_tokens


@fuzz(150)
@given(data=st.data())
def test_hostile_head_slice_fetches_from_a_prefill_rank(live, data):
    seed = _fetch_seed(live).SerializeToString()
    raw = data.draw(mutated(st.just(seed)) | st.binary(max_size=120))
    rank1 = live.pairs.endpoints[2][1][0]
    try:
        frames = list(live.call(rank1, "FetchKV", raw, stream=True))
    except grpc.RpcError as exc:
        _refused_as_documented(exc, raw, pb.FetchKVRequest)
        return
    request = pb.FetchKVRequest.FromString(raw)
    assert request.handle.request_id == RID and frames  # a genuine fetch of the lease's KV
    for frame in frames:
        _header, payload = decode_frame(frame)
        assert payload


@fuzz(150)
@given(data=st.data())
def test_an_import_without_the_replica_secret_is_refused_before_anything_moves(live, data):
    seed = _import_seed(live).SerializeToString()
    raw = data.draw(mutated(st.just(seed)) | st.binary(max_size=120))
    decode_rank1 = live.pairs.client[2].ranks[0]
    with pytest.raises(grpc.RpcError) as refused:
        live.call(decode_rank1, "ImportKV", raw, stream=False)
    _refused_as_documented(refused.value, raw, pb.ImportKVRequest)
    if refused.value.code() not in NOT_THE_MESSAGE:
        # The secret is checked first: nothing of the request is parsed further, no peer dialled.
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()
