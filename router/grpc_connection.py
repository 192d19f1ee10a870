"""`GrpcConnection`: one client connection to the router's own gRPC endpoint
(router/grpc_endpoint.py): HTTP/2 through the `h2` package's state machine (framing, HPACK,
SETTINGS, PING, flow control, stream states, protocol errors), gRPC's framing on top.

Why not grpc.aio: its server makes one `sendmsg` for every message it streams, and with the
state it keeps around each it cost more CPU per message than the rest of the router; here every
message a loop turn produces for a connection (an engine step's tokens for all its streams)
goes out in one socket write, the turn after (the serving benchmark's gRPC reference rows).

Backpressure is HTTP/2's: a response the stream's or the connection's send window does not
take waits in its call (`GrpcCall.pending`), and the call's next message waits with it, so the
router coalesces what the client has not taken (router/token_stream.py), as it did behind
grpc.aio. While the socket's own buffer is full (`pause_writing`) every response waits.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from hyperframe.frame import GoAwayFrame

from router.grpc_call import GrpcCall, Method

log = logging.getLogger("ray.serve." + __name__)
# Streams a client may hold open on one connection (grpc's own server sets no limit; h2's
# default of 100 would queue a larger batch of streams at the client).
MAX_STREAMS = 4096
MAX_HEADER_LIST_BYTES = 16 << 10
# Response bytes framed in one loop turn before a sender waits for the turn's write: a method
# that yields without awaiting cannot starve the loop or buffer without bound.
TURN_BYTES = 64 << 10
_H2 = h2.config.H2Configuration(client_side=False, header_encoding=None)
_RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))
_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")  # grpc-message as it is


def status_headers(code: grpc.StatusCode, details: str) -> list[tuple[bytes, bytes]]:
    """`grpc-status` and `grpc-message` (percent-encoded UTF-8, as gRPC's spec has it)."""
    headers = [(b"grpc-status", str(code.value[0]).encode())]
    if details:
        headers.append((b"grpc-message", quote(details, safe=_SAFE).encode()))
    return headers


class GrpcConnection(asyncio.Protocol):
    """HTTP/2 events in, `GrpcCall`s run; their responses framed through `h2` and written
    once per loop turn (`send` and `end`, called from the calls' tasks)."""

    def __init__(self, methods: dict[bytes, Method], connections: set[GrpcConnection]) -> None:
        self.methods = methods
        self.connections = connections  # the endpoint's open connections
        self.h2 = h2.connection.H2Connection(_H2)
        self.calls: dict[int, GrpcCall] = {}
        self.waiting: set[GrpcCall] = set()  # calls whose responses a window holds back
        self.paused = False
        self.stopping = False
        self.flush_due = False
        self.unflushed = 0  # response bytes framed since the last flush
        self.flushed: asyncio.Future | None = None  # set by the next flush
        self.transport: asyncio.Transport | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self.connections.add(self)
        self.h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_BYTES,
            },
        )
        self.h2.initiate_connection()
        self.flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            log.info("closing a gRPC connection on a protocol error: %s", e)
            self.flush()  # h2's GOAWAY
            self.transport.close()
            return
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                call = self.calls.get(event.stream_id)
                if call is not None:
                    call.receive(event.data)
            elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                self.pump()
            elif isinstance(event, h2.events.RequestReceived):
                self.open(event.stream_id, dict(event.headers))
            elif isinstance(event, h2.events.StreamEnded):
                self.start(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                call = self.calls.pop(event.stream_id, None)
                if call is not None:
                    call.cancel(gone=True)
                    self.waiting.discard(call)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.transport.close()
        self.flush()

    def connection_lost(self, exc) -> None:
        self.connections.discard(self)
        for call in list(self.calls.values()):
            call.cancel(gone=True)
        self.calls.clear()
        self.waiting.clear()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.pump()
        self.flush()

    # -- calls ---------------------------------------------------------------------------

    def open(self, stream_id: int, headers: dict[bytes, bytes]) -> None:
        """A request's headers: an HTTP-level refusal at once, or a call waiting for its
        request message."""
        if self.stopping:
            self.h2.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
        elif headers.get(b":method") != b"POST":
            self.h2.send_headers(stream_id, [(b":status", b"405")], end_stream=True)
        elif not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            self.h2.send_headers(stream_id, [(b":status", b"415")], end_stream=True)
        elif headers.get(b"grpc-encoding", b"identity") != b"identity":
            details = f"grpc-encoding {headers[b'grpc-encoding']!r} is not supported"
            self.h2.send_headers(
                stream_id,
                [*_RESPONSE_HEADERS, (b"grpc-accept-encoding", b"identity")]
                + status_headers(grpc.StatusCode.UNIMPLEMENTED, details),
                end_stream=True,
            )
        else:
            self.calls[stream_id] = GrpcCall(self, stream_id, headers)

    def start(self, stream_id: int) -> None:
        """The request is whole: run its call."""
        call = self.calls.get(stream_id)
        if call is not None and call.task is None:
            method = self.methods.get(call.headers.get(b":path", b""))
            call.task = self.loop.create_task(call.run(method))

    def forget(self, call: GrpcCall) -> None:
        if self.calls.get(call.stream_id) is call:
            del self.calls[call.stream_id]
        self.waiting.discard(call)

    def send(self, call: GrpcCall, message: Any) -> asyncio.Future | None:
        """Frame one response for `call`; a future to wait on while flow control (or a full
        socket buffer) holds it back, or until this turn's write once `TURN_BYTES` are framed;
        else None."""
        if call.gone:
            raise asyncio.CancelledError  # the stream is reset: its method is closed
        body = message.SerializeToString()
        data = b"\x00" + len(body).to_bytes(4, "big") + body
        if not call.headers_sent:
            self.h2.send_headers(call.stream_id, _RESPONSE_HEADERS)
            call.headers_sent = True
        if (
            not call.pending
            and not self.paused
            and len(data) <= self.h2.max_outbound_frame_size
            and len(data) <= self.h2.local_flow_control_window(call.stream_id)
        ):
            self.h2.send_data(call.stream_id, data)
            self._flush_soon()
            self.unflushed += len(data)
            if self.unflushed < TURN_BYTES:
                return None
            if self.flushed is None:
                self.flushed = self.loop.create_future()
            return asyncio.shield(self.flushed)  # a waiter's cancel must not reach the others
        call.pending += data
        self.pump_call(call)
        self._flush_soon()
        if not call.pending:
            return None
        call.drained = self.loop.create_future()
        self.waiting.add(call)
        return call.drained

    def end(self, call: GrpcCall, code: grpc.StatusCode, details: str) -> None:
        """The call's status: trailers after its responses, or alone (trailers-only) when it
        sent none. Responses still held back by flow control are dropped (only an error or a
        deadline ends a call with some)."""
        if call.gone or self.calls.get(call.stream_id) is not call:
            return
        call.pending.clear()
        headers = status_headers(code, details)
        if not call.headers_sent:
            headers = [*_RESPONSE_HEADERS, *headers]
        try:
            self.h2.send_headers(call.stream_id, headers, end_stream=True)
        except h2.exceptions.StreamClosedError:
            return  # reset by the client meanwhile
        self._flush_soon()

    # -- writing -------------------------------------------------------------------------

    def pump(self) -> None:
        """Hand on what flow control held back, now that a window grew."""
        for call in list(self.waiting):
            self.pump_call(call)

    def pump_call(self, call: GrpcCall) -> None:
        while call.pending and not self.paused:
            room = min(
                self.h2.local_flow_control_window(call.stream_id),
                self.h2.max_outbound_frame_size,
                len(call.pending),
            )
            if room <= 0:
                return
            self.h2.send_data(call.stream_id, bytes(call.pending[:room]))
            del call.pending[:room]
        if not call.pending:
            self.waiting.discard(call)
            if call.drained is not None and not call.drained.done():
                call.drained.set_result(None)
            self._flush_soon()

    def _flush_soon(self) -> None:
        if not self.flush_due:
            self.flush_due = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write all `h2` has framed since the last flush, in one write."""
        self.flush_due, self.unflushed = False, 0
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
        if self.flushed is not None:
            self.flushed.set_result(None)  # shielded from its waiters' cancels
            self.flushed = None

    def go_away(self) -> None:
        """Tell the client to open no more streams here (GOAWAY, no error); those under way go
        on. Written past `h2`, whose GOAWAY would close the connection for them too."""
        self.stopping = True
        self.flush()
        last = self.h2.highest_inbound_stream_id
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(GoAwayFrame(0, last_stream_id=last, error_code=0).serialize())

    def close(self) -> None:
        self.flush()
        if self.transport is not None:
            self.transport.close()
