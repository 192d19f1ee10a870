"""A hostile HTTP/2 client for the direct endpoint's limit tests: frames written as bytes
(`hyperframe`, `hpack`), no state machine, so it sends what a well-behaved client never would
(no preface, PINGs by the thousand, bodies that never end, headers before it has read the
server's SETTINGS) and reads the server's frames as they come. `MemoryTransport`: a
connection's transport with no socket, for feeding it bytes directly."""

from __future__ import annotations

import asyncio
from typing import Any

from hpack import Encoder
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    SettingsFrame,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def ping(n: int = 0) -> bytes:
    return PingFrame(0, opaque_data=n.to_bytes(8, "big")).serialize()


def headers(stream_id: int, fields, end_stream: bool = False, encoder=None) -> bytes:
    frame = HeadersFrame(stream_id, flags=["END_HEADERS"] + (["END_STREAM"] if end_stream else []))
    frame.data = (encoder or Encoder()).encode(fields)
    return frame.serialize()


def data(stream_id: int, payload: bytes, end_stream: bool = False) -> bytes:
    """DATA frames of at most 16 KiB (the default largest frame) carrying `payload`."""
    pieces = [payload[i : i + 16384] for i in range(0, len(payload), 16384)] or [b""]
    last = len(pieces) - 1
    return b"".join(
        DataFrame(
            stream_id, p, flags=["END_STREAM"] if end_stream and i == last else []
        ).serialize()
        for i, p in enumerate(pieces)
    )


class Wire:
    """One connection: bytes out as given, frames in as parsed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = Encoder()

    @classmethod
    async def connect(cls, endpoint: str, handshake: bool = True) -> Wire:
        host, port = endpoint.rsplit(":", 1)
        wire = cls(*await asyncio.open_connection(host, int(port)))
        if handshake:
            wire.send(PREFACE + SettingsFrame(0).serialize())
        return wire

    def send(self, payload: bytes) -> None:
        self.writer.write(payload)

    def headers(self, stream_id: int, fields, end_stream: bool = False) -> None:
        self.send(headers(stream_id, fields, end_stream, self.encoder))

    async def frame(self, timeout_s: float = 5.0) -> Frame | None:
        """The next frame; None at the connection's end."""
        async with asyncio.timeout(timeout_s):
            try:
                head = await self.reader.readexactly(9)
                frame, length = Frame.parse_frame_header(memoryview(head))
                frame.parse_body(memoryview(await self.reader.readexactly(length)))
            except (asyncio.IncompleteReadError, ConnectionError):
                return None
        return frame

    async def for_a_while(self, seconds: float) -> list[Frame]:
        """The frames that come within `seconds` (fewer if the connection ends)."""
        frames = []
        try:
            async with asyncio.timeout(seconds):
                while (frame := await self.frame(seconds)) is not None:
                    frames.append(frame)
        except TimeoutError:
            pass
        return frames

    async def until_closed(self, timeout_s: float = 5.0) -> list[Frame]:
        """Every frame to the connection's end."""
        frames = []
        async with asyncio.timeout(timeout_s):
            while (frame := await self.frame(timeout_s)) is not None:
                frames.append(frame)
        return frames

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


def goaway(frames: list[Frame]) -> GoAwayFrame | None:
    return next((f for f in frames if isinstance(f, GoAwayFrame)), None)


class MemoryTransport(asyncio.Transport):
    """What the connection writes, kept; closing is recorded and reported as lost."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = False
        self.protocol: Any = None

    def write(self, data) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    abort = close

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name, default=None):
        return default
