"""Fuzzing what a KV server and a decode worker parse from a peer: `KVHandle.from_proto` (a
handle in any KV request), `layout_from_proto`, `split_endpoint` and the capability tokens
(`Capability.verify`, `verify_cancel`), and the NIXL pool description a decode worker gets
from `ConnectNixl` (`check_description`). A malformed handle is InvalidArgument naming what is
wrong; a token check is True only for the genuine token and never raises."""

from __future__ import annotations

from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from cluster.errors import FailedPrecondition, InvalidArgument
from cluster.kv_transfer.capability import TOKEN_BYTES, Capability
from cluster.kv_transfer.kv_handle import KVHandle, split_endpoint
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
