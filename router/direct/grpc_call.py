"""`GrpcCall`: one call on a `GrpcServer` (grpc_server.py), from its request headers to its
trailers, run in a task of its own once the request has arrived whole.

The call is also the servicer's context: a method reports an error's status with `set_code`
and `set_details` (as the router's do, router/router.py) and raises; a method that raises
without a code ends the call UNKNOWN, as grpc.aio's server does. The call ends one way of
four: its status in trailers (the method's end, its error, or its deadline's
DEADLINE_EXCEEDED); UNAVAILABLE when the server stops with the call still under way past the
grace; or silently when the client reset the stream or the connection was lost. In every case
the method's stream is closed (`aclosing`): that is where the router frees a generation's KV.
"""

from __future__ import annotations

import asyncio
import re
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

OK = grpc.StatusCode.OK
# The largest request message taken, as grpc's default receive limit (4 MiB).
MAX_REQUEST_BYTES = 4 << 20
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

    def receive(self, data: bytes) -> None:
        if len(self.body) + len(data) > MAX_REQUEST_BYTES + 5:
            self.too_large = True  # its bytes are still acknowledged, not kept
        elif not self.too_large:
            self.body += data

    def request(self, method: Method) -> Any:
        """The one request message, checked: size, framing, no compression, parseable."""
        if self.too_large:
            raise CallEnded(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request larger than the limit of {MAX_REQUEST_BYTES} bytes",
            )
        body = bytes(self.body)
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
