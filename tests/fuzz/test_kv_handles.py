"""Fuzzing what a KV server and a decode worker parse from a peer: `KVHandle.from_proto` (a
handle in any KV request), `layout_from_proto`, `split_endpoint` and the capability tokens
(`Capability.verify`, `verify_cancel`), and the NIXL pool description a decode worker gets
from `ConnectNixl` (`check_description`). A malformed handle is InvalidArgument naming what is
wrong; a token check is True only for the genuine token and never raises."""

from __future__ import annotations

from dataclasses import replace

from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from cluster.engine.kv_cache import KVLayout
from cluster.errors import FailedPrecondition, InvalidArgument
from cluster.kv_transfer.capability import TOKEN_BYTES, Capability
from cluster.kv_transfer.grpc.tp_ranks import head_plan, rank_heads
from cluster.kv_transfer.kv_handle import MAX_TP_SIZE, KVHandle, layout_from_proto, split_endpoint
from cluster.kv_transfer.nixl.nixl_pool import MAX_POOL_BLOCKS, check_description, pool_rows
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from tests.fuzz.fuzzing import fuzz, mutated, seeds, with_seeds
from tests.fuzz.make_corpus import LAYOUT, SECRET

CAPABILITY = Capability(SECRET)


def parse(raw: bytes) -> KVHandle | None:
    """A handle from wire bytes as a server gets them: protobuf's own DecodeError (gRPC refuses
    the call before any handler runs) or InvalidArgument, else a handle whose invariants hold."""
    try:
        msg = pb.KVHandle.FromString(raw)
    except DecodeError:
        return None
    try:
        handle = KVHandle.from_proto(msg)
    except InvalidArgument as exc:
        assert exc.message.startswith("KV "), exc.message
        return None
    assert len(handle.block_ids) == -(-handle.num_tokens // handle.block_size)
    assert len(set(handle.block_ids)) == len(handle.block_ids)
    layout = handle.layout
    assert 1 <= layout.tp_size <= MAX_TP_SIZE and layout.head_end <= layout.total_kv_heads
    assert len(handle.rank_endpoints) == layout.tp_size - 1
    assert all(split_endpoint(e)[1] > 0 for e in handle.rank_endpoints)
    assert KVHandle.from_proto(handle.to_proto()) == handle
    return handle


def test_every_seed_is_a_handle_with_a_genuine_token():
    for raw in seeds("kv_handle"):
        handle = parse(raw)
        assert handle is not None
        assert CAPABILITY.verify(handle.request_id, handle.block_ids, handle.capability_token)


@fuzz(700)
@with_seeds("kv_handle")
@given(st.binary(max_size=300) | mutated(st.sampled_from(seeds("kv_handle"))))
def test_any_bytes_as_a_handle(raw: bytes):
    handle = parse(raw)
    if handle is not None:
        genuine = CAPABILITY.verify(handle.request_id, handle.block_ids, handle.capability_token)
        # A mutated handle keeps a genuine token only where the token's inputs are unchanged.
        assert not genuine or handle.capability_token == CAPABILITY.token(
            handle.request_id, handle.block_ids
        )


U32 = st.integers(0, (1 << 32) - 1)


@st.composite
def hostile_handle(draw) -> bytes:
    """A seed handle with fields set to extreme or mismatched values."""
    msg = pb.KVHandle.FromString(draw(st.sampled_from(seeds("kv_handle"))))
    for _ in range(draw(st.integers(1, 3))):
        field = draw(
            st.sampled_from(
                (
                    "request_id",
                    "num_tokens",
                    "endpoint",
                    "transport",
                    "block_ids",
                    "block_size",
                    "layout",
                    "lease_expiry_unix",
                    "capability_token",
                    "first_token_id",
                    "tp",
                    "rank_endpoints",
                )
            )
        )
        if field in ("request_id", "endpoint", "transport"):
            setattr(msg, field, draw(st.text(max_size=30)))
        elif field in ("num_tokens", "block_size", "first_token_id"):
            setattr(msg, field, draw(U32))
        elif field == "block_ids":
            del msg.block_ids[:]
            msg.block_ids.extend(draw(st.lists(U32, max_size=8)))
        elif field == "layout":
            msg.layout.num_layers = draw(U32)
            msg.layout.block_size = draw(U32)
            msg.layout.dtype = draw(st.sampled_from(("", "float32", "int4", "float16")))
            if draw(st.booleans()):
                msg.ClearField("layout")
        elif field == "tp":  # the heads a rank of a TP group claims to hold
            small = st.sampled_from((0, 1, 2, 3, 4, 64, 65))
            if draw(st.booleans()):  # a coherent rank 0 of some TP size, then maybe one lie
                tp, total = draw(small), draw(st.sampled_from((1, 2, 3, 4)))
                msg.layout.tp_size, msg.layout.total_kv_heads = tp, total
                msg.layout.num_kv_heads, msg.layout.kv_head_start = max(1, total // max(tp, 1)), 0
                del msg.rank_endpoints[:]
                msg.rank_endpoints.extend(f"127.0.0.1:{7402 + r}" for r in range(1, tp))
            for name in ("num_kv_heads", "kv_head_start", "total_kv_heads", "tp_size"):
                if draw(st.integers(0, 3)) == 0:
                    setattr(msg.layout, name, draw(small | U32))
        elif field == "rank_endpoints":
            del msg.rank_endpoints[:]
            hosts = st.sampled_from(("127.0.0.1:7402", "[::1]:7", "h:0", "h", ":1", "")) | st.text(
                max_size=12
            )
            msg.rank_endpoints.extend(draw(st.lists(hosts, max_size=5)))
        elif field == "lease_expiry_unix":
            msg.lease_expiry_unix = draw(st.floats())
        else:
            msg.capability_token = draw(st.binary(max_size=40))
    return msg.SerializeToString()


@fuzz(600)
@given(hostile_handle())
def test_hostile_field_values(raw: bytes):
    parse(raw)


@fuzz(600)
@given(
    st.text(max_size=30)
    | st.from_regex(r"\A\[?[0-9a-z:.]{0,12}\]?:[0-9\u0660-\u0669\u00b2\u00b3]{0,7}\Z")
)
def test_any_endpoint_is_host_and_port_or_refused(endpoint: str):
    try:
        host, port = split_endpoint(endpoint)
    except InvalidArgument as exc:
        assert exc.message.startswith("KV endpoint must be host:port"), exc.message
        return
    digits = endpoint.rpartition(":")[2]
    assert host and 0 < port < 65536 and digits.isascii() and int(digits) == port


@fuzz(800)
@given(
    st.text(max_size=20),
    st.lists(st.integers(-(1 << 65), 1 << 65) | st.booleans(), max_size=6),
    st.binary(max_size=40) | st.integers() | st.none() | st.text(max_size=32),
)
def test_a_token_check_is_a_bool_and_true_only_for_the_genuine_token(rid, block_ids, token):
    assert CAPABILITY.verify(rid, block_ids, token) is False or (
        token == CAPABILITY.token(rid, block_ids)
    )
    assert CAPABILITY.verify_cancel(rid, token) is False or token == CAPABILITY.cancel_token(rid)
    if isinstance(token, bytes) and len(token) == TOKEN_BYTES and rid.isprintable():
        # The cancel domain never yields a lease's token.
        assert not CAPABILITY.verify(rid, [], CAPABILITY.cancel_token(rid))


@st.composite
def hostile_pool(draw) -> pb.NixlPool:
    """A NIXL pool description as a decode worker gets it from `ConnectNixl`, every field
    drawn from values near and far from the reader's own layout."""
    block_bytes = LAYOUT.block_size * LAYOUT.num_kv_heads * LAYOUT.head_dim * 4
    near = st.sampled_from((0, 1, block_bytes, 2 * block_bytes, 1 << 20, (1 << 64) - 1))
    u64 = near | st.integers(0, (1 << 64) - 1)
    return pb.NixlPool(
        agent_name=draw(st.text(max_size=300)),
        agent_metadata=draw(st.binary(max_size=8)),
        mem_type=draw(st.sampled_from(("DRAM", "VRAM", "", "FILE"))),
        device_id=draw(st.integers(0, (1 << 32) - 1)),
        k_base=draw(u64),
        v_base=draw(u64),
        layer_stride=draw(u64),
        block_stride=draw(u64),
        block_bytes=draw(u64),
        num_layers=draw(st.sampled_from((0, LAYOUT.num_layers, 1 << 31))),
        num_blocks=draw(st.integers(0, (1 << 32) - 1)),
    )


@fuzz(600)
@given(hostile_pool())
def test_a_nixl_pool_description_is_checked_before_any_descriptor_is_built(desc: pb.NixlPool):
    try:
        check_description(desc, LAYOUT)
    except (InvalidArgument, FailedPrecondition) as exc:
        assert "NIXL" in exc.message or "pool" in exc.message, exc.message
        return
    # Taken: every descriptor it implies lies inside the 64-bit address space, blocks apart.
    rows = pool_rows(
        (desc.k_base, desc.v_base),
        desc.num_layers,
        (desc.layer_stride, desc.block_stride, desc.block_bytes),
        desc.num_blocks,
        desc.device_id,
    )
    assert rows.shape == (2 * LAYOUT.num_layers, 5) and desc.num_blocks <= MAX_POOL_BLOCKS


def _rank_layout(tp: int, rank: int) -> KVLayout:
    heads = rank_heads(LAYOUT.num_kv_heads, tp, rank)
    return replace(LAYOUT, num_kv_heads=len(heads), kv_head_start=heads.start, tp_size=tp)


# A decode rank's pool of every TP size the two-head fuzz model splits into.
READERS = [_rank_layout(tp, r) for tp in (1, 2, 4) for r in range(tp)]


@st.composite
def rank0_layout(draw) -> KVLayout | None:
    """The layout a handle carries (its prefill rank 0's), parsed from the wire: a coherent
    one of some TP size, then maybe a field or two replaced by any value."""
    small = st.sampled_from((0, 1, 2, 3, 4, 8, 64, 65))
    tp, total = draw(small), draw(st.sampled_from((2, 2, 2, 1, 3, 4)))
    fields = dict(LAYOUT.to_dict(), tp_size=tp, total_kv_heads=total, kv_head_start=0)
    fields["num_kv_heads"] = max(1, total // max(tp, 1))
    for name in ("num_kv_heads", "kv_head_start", "total_kv_heads", "tp_size"):
        if draw(st.integers(0, 4)) == 0:
            fields[name] = draw(small | U32)
    try:
        return layout_from_proto(pb.KVLayout(**fields))
    except InvalidArgument:
        return None


@fuzz(600)
@given(rank0_layout(), st.sampled_from(READERS))
def test_a_head_plan_reads_exactly_the_readers_heads_from_ranks_that_hold_them(source, reader):
    """What a decode rank reads, planned from a handle's (prefill rank 0's) layout: every head
    of its own once, in order, each from a prefill rank of the handle's TP size that holds it;
    a layout of another model or heads that do not split is FailedPrecondition."""
    if source is None:
        return
    try:
        runs = head_plan(source, reader)
    except FailedPrecondition:
        return
    covered = []
    for run in runs:
        assert 0 <= run.rank < source.tp_size and run.count >= 1
        held = rank_heads(source.total_kv_heads, source.tp_size, run.rank)
        assert held.start <= run.start and run.start + run.count <= held.stop
        assert run.offset == run.start - reader.kv_head_start
        covered.extend(range(run.start, run.start + run.count))
    assert covered == list(range(reader.kv_head_start, reader.head_end))
