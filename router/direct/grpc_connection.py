"""`GrpcConnection`: one client connection to a `GrpcServer` (grpc_server.py): HTTP/2 through
the `h2` package's state machine (framing, HPACK, SETTINGS, PING, flow control, stream states,
protocol errors), gRPC's framing on top.

Why not grpc.aio: its server makes one `sendmsg` for every message it streams, and keeps state
around each; here every message a loop turn produces for a connection (for the router, an
engine step's tokens for all its streams) goes out in one socket write, the turn after.

Backpressure is HTTP/2's both ways. A response the stream's or the connection's send window
does not take waits in its call (`GrpcCall.pending`), and the call's next message waits with
it, so a method that coalesces what its client has not taken (the router does,
router/token_stream.py) sends fewer, larger messages to a slow reader; while the socket's own
buffer is full (`pause_writing`) every response waits, and a client that lets the frames h2
answers on its own pile up past `DirectLimits.write_buffer_bytes` is dropped. A request's
bytes are acknowledged only once its call reads them (grpc_call.py), so the windows the
endpoint advertises (`stream_window_bytes`, `connection_window_bytes`) are what a client can
make it hold. Timers and the ping policy: connection_guard.py.
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

from router.direct.admission import Admission
from router.direct.connection_guard import ConnectionGuard
from router.direct.frame_check import FrameCheck
from router.direct.grpc_call import GrpcCall, Method
from router.direct.limits import DEFAULT_WINDOW, DirectLimits

log = logging.getLogger("ray.serve." + __name__)
# Response bytes framed in one loop turn before a sender waits for the turn's write: a method
# that yields without awaiting cannot starve the loop or buffer without bound.
TURN_BYTES = 64 << 10
_H2 = h2.config.H2Configuration(client_side=False, header_encoding=None)
_RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))
_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")  # grpc-message as it is
_CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
# Bytes handed to h2 at once (`data_received`).
READ_SLICE = 16 << 10


def status_headers(code: grpc.StatusCode, details: str) -> list[tuple[bytes, bytes]]:
    """`grpc-status` and `grpc-message` (percent-encoded UTF-8, as gRPC's spec has it)."""
    headers = [(b"grpc-status", str(code.value[0]).encode())]
    if details:
        headers.append((b"grpc-message", quote(details, safe=_SAFE).encode()))
    return headers


class GrpcConnection(asyncio.Protocol):
    """HTTP/2 events in, `GrpcCall`s run; their responses framed through `h2` and written
    once per loop turn (`send` and `end`, called from the calls' tasks)."""

    def __init__(
        self,
        methods: dict[bytes, Method],
        connections: set[GrpcConnection],
        limits: DirectLimits,
        admission: Admission | None = None,
    ) -> None:
        self.methods = methods
        self.connections = connections  # the server's open connections
        self.limits = limits
        self.admission = admission
        self.h2 = h2.connection.H2Connection(_H2)
        self.frames = FrameCheck()  # frame headers, checked before h2 buffers their frames
        self.calls: dict[int, GrpcCall] = {}
        self.waiting: set[GrpcCall] = set()  # calls whose responses a window holds back
        self.paused = False
        self.stopping = False
        self.flush_due = False
        self.unflushed = 0  # response bytes framed since the last flush
        self.flushed: asyncio.Future | None = None  # set by the next flush
        self.transport: asyncio.Transport | None = None
        self.guard: ConnectionGuard | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        if len(self.connections) >= self.limits.max_connections:
            log.warning("refusing a gRPC connection: %d open", len(self.connections))
            transport.write(GoAwayFrame(0, last_stream_id=0, error_code=_CALM).serialize())
            transport.close()
            return
        self.connections.add(self)
        limits = self.limits
        self.h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_streams,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_bytes,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: limits.stream_window_bytes,
            },
        )
        # Settings given as initial values are in force at once, as h2 applies none of them
        # to its HPACK decoder: the header list limit is set there too (else h2's default),
        # so it holds before the client acknowledges the SETTINGS that announce it.
        self.h2.decoder.max_header_list_size = limits.max_header_list_bytes
        self.h2.initiate_connection()
        if limits.connection_window_bytes > DEFAULT_WINDOW:
            self.h2.increment_flow_control_window(limits.connection_window_bytes - DEFAULT_WINDOW)
        self.guard = ConnectionGuard(self, limits)
        self.flush()

    def data_received(self, data: bytes) -> None:
        """Hand `data` to h2 a slice at a time: h2 parses all it is given before its events
        are seen, so a read of tiny frames (a flood of PINGs) would become that many events
        and answers at once; a slice bounds them, and a flood stops at the slice that ends
        the connection. Each slice's frame headers are checked first (frame_check.py): the
        bytes before one that fails go to h2, then GOAWAY with its error."""
        for start in range(0, len(data), READ_SLICE):
            if self.guard is None or self.closed():
                return  # refused, or ended by what came before
            piece = data[start : start + READ_SLICE]
            failed = self.frames.check(
                piece, self.h2.max_inbound_frame_size, self.limits.header_block_bytes
            )
            self._receive(piece if failed is None else piece[: failed[0]])
            if failed is not None and not self.closed():
                self.refuse(
                    failed[1],
                    "a frame header (SETTINGS not first, too long a frame or header block)",
                )
        if self.guard is not None and not self.closed():
            if self.calls:
                self.guard.busy()
            else:
                self.guard.quiet()
        self.flush()

    def _receive(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            self.refuse(h2.errors.ErrorCodes.PROTOCOL_ERROR, e)
            return
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                call = self.calls.get(event.stream_id)
                size = event.flow_controlled_length
                ack = size if call is None else call.receive(event.data, size)
                if ack:
                    self.h2.acknowledge_received_data(ack, event.stream_id)
            elif isinstance(event, h2.events.WindowUpdated):
                self.pump()
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                self.guard.handshake_done()
                self.pump()
            elif isinstance(event, h2.events.PingReceived):
                if self.guard.ping():
                    self.calm_down()
                    return
            elif isinstance(event, h2.events.RequestReceived):
                self.open(event.stream_id, dict(event.headers))
            elif isinstance(event, h2.events.StreamEnded):
                self.start(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                call = self.calls.get(event.stream_id)
                if call is not None:
                    call.cancel(gone=True)
                    self.forget(call)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.close()
                return

    def connection_lost(self, exc) -> None:
        self.connections.discard(self)
        if self.guard is not None:
            self.guard.stop()
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
        request message. A refusal of a stream the client has reset already (later in the
        same read), or on a connection h2 has closed, is dropped (`on_stream`)."""
        if self.stopping:
            self.on_stream(self.h2.reset_stream, stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        if headers.get(b":method") != b"POST":
            refusal = [(b":status", b"405")]
        elif not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            refusal = [(b":status", b"415")]
        elif headers.get(b"grpc-encoding", b"identity") != b"identity":
            details = f"grpc-encoding {headers[b'grpc-encoding']!r} is not supported"
            refusal = [*_RESPONSE_HEADERS, (b"grpc-accept-encoding", b"identity")]
            refusal += status_headers(grpc.StatusCode.UNIMPLEMENTED, details)
        else:
            self.calls[stream_id] = GrpcCall(self, stream_id, headers)
            return
        self.on_stream(self.h2.send_headers, stream_id, refusal, end_stream=True)

    def start(self, stream_id: int) -> None:
        """The request is whole: run its call, unless h2 closed the connection (no answer)."""
        call = self.calls.get(stream_id)
        if call is not None and call.task is None and not self.h2_closed():
            method = self.methods.get(call.headers.get(b":path", b""))
            call.task = self.loop.create_task(call.run(method))

    def consumed(self, call: GrpcCall) -> None:
        """`call` read its request: give the bytes' window back to the client."""
        if call.unacked and not self.closed():
            self.h2.acknowledge_received_data(call.unacked, call.stream_id)
            self._flush_soon()
        call.unacked = 0

    def forget(self, call: GrpcCall) -> None:
        if self.calls.get(call.stream_id) is call:
            del self.calls[call.stream_id]
            if not self.calls and self.guard is not None:
                self.guard.quiet()
        self.waiting.discard(call)
        self.consumed(call)  # a request never read, dropped: its bytes are free again

    def send(self, call: GrpcCall, message: Any) -> asyncio.Future | None:
        """Frame one response for `call`; a future to wait on while flow control (or a full
        socket buffer) holds it back, or until this turn's write once `TURN_BYTES` are framed;
        else None."""
        if call.gone or self.h2_closed():  # the stream is reset, or the connection closed:
            call.gone = call.interrupted = True  # this is the task's one cancel
            raise asyncio.CancelledError  # and its method is closed
        body = message.SerializeToString()
        data = b"\x00" + len(body).to_bytes(4, "big") + body
        if not call.headers_sent:
            self.h2.send_headers(call.stream_id, _RESPONSE_HEADERS)
            call.headers_sent = True
        self.guard.sent()
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
        if self.on_stream(self.h2.send_headers, call.stream_id, headers, end_stream=True):
            self.guard.sent()
            self._flush_soon()

    def on_stream(self, send: Any, *args: Any, **kwargs: Any) -> bool:
        """`send`, an h2 method framing for one stream; nothing, and False, where the stream
        is closed (reset, in this read or before) or the connection is (the client's GOAWAY, a
        connection error): one stream's end never reaches the others, nor a call's task."""
        if self.h2_closed():
            return False
        try:
            send(*args, **kwargs)
        except (h2.exceptions.StreamClosedError, h2.exceptions.StreamIDTooLowError):
            return False  # too low: closed, and forgotten since (h2 lets closed streams go)
        return True

    def h2_closed(self) -> bool:
        return self.h2.state_machine.state is h2.connection.ConnectionState.CLOSED

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
            if not self.on_stream(self.h2.send_data, call.stream_id, bytes(call.pending[:room])):
                call.pending.clear()  # the stream or the connection is closed: no client
                call.cancel(gone=True)
                break
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
        if data and not self.closed():
            self.transport.write(data)
            if self.transport.get_write_buffer_size() > self.limits.write_buffer_bytes:
                self.abort("the client does not read what it is sent")
        if self.flushed is not None:
            self.flushed.set_result(None)  # shielded from its waiters' cancels
            self.flushed = None

    def go_away(self) -> None:
        """Tell the client to open no more streams here (GOAWAY, no error); those under way go
        on. Written past `h2`, whose GOAWAY would close the connection for them too."""
        self.stopping = True
        self.flush()
        last = self.h2.highest_inbound_stream_id
        if not self.closed():
            self.transport.write(GoAwayFrame(0, last_stream_id=last, error_code=0).serialize())

    def close(self) -> None:
        self.flush()
        if self.transport is not None:
            self.transport.close()

    # -- limits (connection_guard.py) ----------------------------------------------------

    def closed(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def abort(self, why: str) -> None:
        """Drop the connection at once, nothing more sent."""
        log.info("dropping a gRPC connection: %s", why)
        if self.transport is not None:
            self.transport.abort()

    def refuse(self, error: h2.errors.ErrorCodes, why: object) -> None:
        """A connection error: GOAWAY with `error` (unless h2 has sent its own), then close."""
        log.info("closing a gRPC connection on a protocol error (%s): %s", error.name, why)
        if not self.h2_closed():  # h2 sends none for a bad preface: this one is ours
            self.h2.close_connection(error_code=error)
        self.close()  # after the GOAWAY

    def calm_down(self) -> None:
        """Too many PINGs: GOAWAY ENHANCE_YOUR_CALM, and the connection closes."""
        log.info("closing a gRPC connection: too many pings")
        self.h2.close_connection(error_code=_CALM, additional_data=b"too_many_pings")
        self.close()

    def go_away_idle(self) -> None:
        """No stream for `idle_timeout_s`: GOAWAY (no error) and close."""
        self.h2.close_connection(additional_data=b"idle")
        self.close()

    def refuse_unreceived(self, call: GrpcCall) -> None:
        """A request that has not arrived whole within `receive_timeout_s`: DEADLINE_EXCEEDED
        and the stream reset (NO_ERROR: the response is complete), its window given back."""
        details = f"the request did not arrive within {self.limits.receive_timeout_s:g} s"
        self.end(call, grpc.StatusCode.DEADLINE_EXCEEDED, details)
        self.on_stream(self.h2.reset_stream, call.stream_id, h2.errors.ErrorCodes.NO_ERROR)
        self.forget(call)
        self._flush_soon()
