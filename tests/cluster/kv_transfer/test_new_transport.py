"""A KV transport added from outside the repository: a package in a temporary folder, made known
by one `registry.register` line, served by the prefill worker's `KVServer` (which mounts its
RPC) and used by the decode side through the registry, moves a prompt's KV from a real prefill
engine's pool into a decode engine's pool bit for bit. No file of the repository changes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from cluster.config import TransferConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.errors import InvalidArgument
from cluster.kv_transfer import registry
from cluster.kv_transfer.base import ClientParts
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.kv_control import KVControl
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.request import Request
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper
from tests.cluster.kv_transfer.kv_pair import BLOCK_SIZE, PARAMS, make_engine, prompt, run

# One unary RPC of its own service: the lease's keys and values as raw bytes, in one message.
LOOP_TRANSPORT = """
from __future__ import annotations

import grpc
import torch

from cluster.engine.kv_cache import KVExport
from cluster.errors import PdServeError
from cluster.kv_transfer.base import KVClient, KVSender
from cluster.kv_transfer.kv_handle import layout_to_proto
from cluster.kv_transfer.kv_server_stubs import rpc_error
from cluster.kv_transfer.kv_wire import DTYPES
from cluster.kv_transfer.lease_pins import abort, pin
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb

SERVICE = "throwaway.Loop"


class LoopSender(KVSender):
    def __init__(self, parts):
        self.parts = parts

    def handlers(self):
        copy = grpc.unary_unary_rpc_method_handler(
            self.copy, request_deserializer=pb.FetchKVRequest.FromString
        )
        return {SERVICE: {"Copy": copy}}

    async def copy(self, request, context):
        try:
            rid, block_ids = await pin(self.parts, request)
        except PdServeError as exc:
            await abort(context, exc)
        try:
            read = lambda pool: pool.gather(block_ids)
            kv = self.parts.async_engine.read_held_kv(rid, block_ids, read)
            return kv.cpu().contiguous().view(torch.uint8).numpy().tobytes()
        finally:
            self.parts.leases.end_fetch(rid)


class LoopClient(KVClient):
    def __init__(self, parts):
        self.control = parts.control
        self.timeout_s = parts.transfer.fetch_timeout_seconds

    async def fetch(self, handle, receiver_layout):
        receiver_layout.check_matches(handle.layout)
        request = pb.FetchKVRequest(
            handle=handle.to_proto(), receiver_layout=layout_to_proto(receiver_layout)
        )
        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(handle.endpoint, options=options) as channel:
            copy = channel.unary_unary(
                f"/{SERVICE}/Copy", request_serializer=pb.FetchKVRequest.SerializeToString
            )
            try:
                data = await copy(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise rpc_error(exc, handle) from None
        shape = (2, receiver_layout.num_layers, len(handle.block_ids), *receiver_layout.block_shape)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        kv = raw.view(DTYPES[receiver_layout.dtype]).reshape(shape)
        return KVExport(receiver_layout, handle.num_tokens, kv[0], kv[1])

    async def release(self, handle, reason):
        return await self.control.release(handle, reason)

    async def close(self):
        await self.control.close()


def make_client(parts):
    return LoopClient(parts)


def make_sender(parts):
    return LoopSender(parts)
"""


@pytest.fixture
def loop_transport(tmp_path: Path, monkeypatch):
    """The throwaway transport "loop", importable from a temporary folder and registered."""
    (tmp_path / "loop_kv").mkdir()
    (tmp_path / "loop_kv" / "__init__.py").write_text(textwrap.dedent(LOOP_TRANSPORT))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register(registry.Transport("loop", "loop_kv"))
    yield "loop"
    registry.unregister("loop")


def test_a_transport_from_a_temporary_folder_moves_kv_bit_exact(llama_dir, loop_transport):
    async def main() -> None:
        prefill, decode = AsyncEngine(make_engine(llama_dir)), AsyncEngine(make_engine(llama_dir))
        prefill.start()
        decode.start()
        leases = LeaseKeeper(prefill, 30.0, Capability(b"test-secret"))
        server = KVServer(
            prefill, leases, prefill.layout, "127.0.0.1", 0, 1 << 20, transport="loop"
        )
        assert server.transport == "loop" and set(server.senders) == {"grpc", "loop"}
        endpoint = await server.start()
        control = KVControl(1 << 20, 30.0)
        parts = ClientParts(TransferConfig(), decode.device, 32, decode.kv_pool, control)
        client = registry.package(loop_transport).make_client(parts)
        try:
            ids = prompt(40, 7)  # three blocks, the last one partial
            request = Request("r1", ids, PARAMS, prefill_only=True)
            outs = [out async for out in await prefill.generate(request)]
            src, num_tokens, expiry, token = await leases.grant("r1")
            handle = KVHandle(
                request_id="r1",
                num_tokens=num_tokens,
                endpoint=endpoint,
                transport=loop_transport,
                block_ids=tuple(src),
                block_size=BLOCK_SIZE,
                layout=prefill.layout,
                lease_expiry_unix=expiry,
                capability_token=token,
                first_token_id=outs[-1].token_ids[0],
            )
            dst = await decode.call(lambda e: e.reserve_import(Request("r1", ids, PARAMS)))
            nbytes = await client.fetch_into(handle, decode.kv_pool, dst)
            want = prefill.kv_pool.gather(src)  # the lease still pins the source blocks
            got = decode.kv_pool.gather(dst)
            assert nbytes == want.nbytes and torch.equal(got, want)
            assert got.abs().sum() > 0  # the prompt's KV, not empty blocks
            assert await client.release(handle, "fetched")
            await decode.call(lambda e: e.cancel_import("r1"))
            assert await leases.drain(5.0), "the lease was never freed"
            for engine in (prefill, decode):
                assert await engine.call(lambda e: e.stats().kv_blocks_used) == 0
        finally:
            await client.close()
            await server.stop(0)
            await leases.stop()
            await prefill.stop()
            await decode.stop()

    run(main())


def test_an_unknown_transport_is_refused_with_the_registered_names():
    with pytest.raises(InvalidArgument, match="one of \\('grpc', 'nixl', 'gloo', 'nccl'\\)"):
        registry.get("loop")
    with pytest.raises(InvalidArgument, match="taken"):
        registry.register(registry.Transport("grpc", "elsewhere"))


def test_the_configs_transport_names_are_the_registrys():
    from cluster.config import TRANSPORTS

    assert TRANSPORTS == ("auto", *registry.names())
