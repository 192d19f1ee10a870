"""`GrpcCall`: one call on a `GrpcServer` (grpc_server.py), from its request headers to its
trailers, run in a task of its own once the request has arrived whole.

The call is also the servicer's context: a method reports an error's status with `set_code`
and `set_details` (as the router's do, router/router.py) and raises; a method that raises
without a code ends the call UNKNOWN, as grpc.aio's server does. The call ends one way of
four: its status in trailers (the method's end, its error, or its deadline's
DEADLINE_EXCEEDED); UNAVAILABLE when the server stops with the call still under way past the
grace; or silently when the client reset the stream or the connection was lost. In every case
the method's stream is closed (`aclosing`): that is where the router frees a generation's KV.

Flow control: a request's bytes are acknowledged (their window given back) when the call reads
them, after the router's admission lets it run (admission.py), not as they arrive; bytes past
the size limit, which are counted and dropped, are acknowledged at once. So a client's windows
bound what its waiting and unfinished requests hold.

`admit` is the one place a call is let run or refused before its method: admission today; a
check of the call's metadata belongs beside it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

OK = grpc.StatusCode.OK
_TIMEOUT = re.compile(rb"(\d{1,8})([HMSmun])")
_TIMEOUT_UNIT_S = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


@dataclass(frozen=True, slots=True)
class Method:
    """One method of the served service: its request type, whether it streams responses, and
    the servicer's function for it (None: UNIMPLEMENTED), called as `function(request, call)`:
    an async generator of responses when `streaming`, else a coroutine of one."""

    request_type: type
    streaming: bool
    function: Any


class CallEnded(Exception):
    """A status to end the call with, found before the method ran."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def parse_timeout(value: bytes) -> float:
    """`grpc-timeout` in seconds: 1-8 digits and a unit (H, M, S, m, u, n)."""
    match = _TIMEOUT.fullmatch(value)
    if match is None:
        raise CallEnded(grpc.StatusCode.INVALID_ARGUMENT, f"bad grpc-timeout {value!r}")
    return int(match.group(1)) * _TIMEOUT_UNIT_S[match.group(2)]


class GrpcCall:
    """One call: the request's bytes as they arrive, then `run` in a task; `send` hands each
    response to the connection, waiting while flow control holds the previous one back."""

    def __init__(self, connection: Any, stream_id: int, headers: dict[bytes, bytes]) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.headers = headers
        self.body = bytearray()
        self.too_large = False
        self.unacked = 0  # request bytes kept and not yet acknowledged
        self.admitted = False  # holds a slot of the router's admission
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.headers_sent = False
        self.gone = False  # the client reset the stream, or the connection is lost
        self.expired = False
        self.stopping = False
        self.interrupted = False  # the task is cancelled already: once is all it gets
        self.task: asyncio.Task | None = None
        self.pending = bytearray()  # response bytes flow control holds back
        self.drained: asyncio.Future | None = None  # set once `pending` is handed on
        self.arrived = asyncio.get_running_loop().time()  # a deadline counts from here
        self.timeout = headers.get(b"grpc-timeout")

    # -- the servicer's context ----------------------------------------------------------

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    # -- the request ---------------------------------------------------------------------

    def receive(self, data: bytes, flow_controlled: int) -> int:
        """Keep a piece of the request; the bytes to acknowledge now (those not kept)."""
        if self.too_large:
            return flow_controlled
        limit = self.connection.limits.max_request_bytes
        self.body += data
        self.unacked += flow_controlled
        declared = int.from_bytes(self.body[1:5], "big") if len(self.body) >= 5 else 0
        if len(self.body) > limit + 5 or declared > limit:
            self.too_large = True  # counted past the limit, not kept
            self.body, kept, self.unacked = bytearray(), self.unacked, 0
            return kept
        return 0

    def request(self, method: Method) -> Any:
        """The one request message, checked: size, framing, no compression, parseable. Its
        bytes are read: their window goes back to the client."""
        self.connection.consumed(self)
        if self.too_large:
            limit = self.connection.limits.max_request_bytes
            raise CallEnded(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request larger than the limit of {limit} bytes",
            )
        body, self.body = bytes(self.body), bytearray()
        if len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            raise CallEnded(grpc.StatusCode.INTERNAL, "expected exactly one request message")
        if body[0] != 0:
            raise CallEnded(grpc.StatusCode.UNIMPLEMENTED, "compressed requests are not taken")
        try:
            return method.request_type.FromString(body[5:])
        except DecodeError:
            raise CallEnded(grpc.StatusCode.INTERNAL, "failed to parse the request") from None

    # -- the call ------------------------------------------------------------------------

    async def run(self, method: Method | None) -> None:
        timer = None
        try:
            if self.timeout is not None:
                at = self.arrived + parse_timeout(self.timeout)
                timer = asyncio.get_running_loop().call_at(at, self._expire)
            if method is None or method.function is None:
                path = self.headers.get(b":path", b"").decode(errors="replace")
                raise CallEnded(grpc.StatusCode.UNIMPLEMENTED, f"method {path} not found")
            async with self.admit():
                request = self.request(method)
                if method.streaming:
                    async with aclosing(method.function(request, self)) as responses:
                        async for response in responses:
                            if (held := self.connection.send(self, response)) is not None:
                                await held
                else:
                    response = await method.function(request, self)
                    if (held := self.connection.send(self, response)) is not None:
                        await held
            self.connection.end(self, self.code or OK, self.details)
        except CallEnded as e:
            self.connection.end(self, e.code, e.details)
        except asyncio.CancelledError:
            if self.expired:
                self.connection.end(self, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            elif self.stopping:
                self.connection.end(self, grpc.StatusCode.UNAVAILABLE, "the server is stopping")
            # else the client is gone: nothing to send
        except Exception as e:
            details = self.details or f"Unexpected {type(e).__name__}: {e}"
            self.connection.end(self, self.code or grpc.StatusCode.UNKNOWN, details)
        finally:
            if timer is not None:
                timer.cancel()
            self.connection.forget(self)

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """A slot of the router's admission for the call's run (none without one), waited
        for in its queue; RESOURCE_EXHAUSTED when the queue is full. While the call holds it,
        the router's method takes no second (admission.py)."""
        admission = self.connection.admission
        if admission is None:
            yield
            return
        try:
            await admission.acquire()
        except admission.refused as e:
            raise CallEnded(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        self.admitted = True
        try:
            yield
        finally:
            admission.release()

    def _expire(self) -> None:
        if self.task is not None and not self.task.done():
            self.expired = True
            self._interrupt()

    def cancel(self, *, gone: bool = False, stopping: bool = False) -> None:
        """End the call's task where it waits: the client left (`gone`: nothing more is
        sent) or the server is stopping."""
        self.gone = self.gone or gone
        self.stopping = self.stopping or stopping
        self._interrupt()

    def _interrupt(self) -> None:
        """Cancel the task once. A second cancel (the client's reset landing just after the
        deadline, or the server's stop after either) would land in the method's clean-up,
        the `aclose` that frees the generation's KV, and cut it short."""
        if self.task is not None and not self.task.done() and not self.interrupted:
            self.interrupted = True
            self.task.cancel()
