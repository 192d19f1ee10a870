"""A raw HTTP/2 client (the `h2` package, client side) for what a gRPC library never sends: odd
headers, broken framing, a `grpc-timeout` with no deadline of the client's behind it, a socket
dropped mid-stream. One call per stream; the answer's headers, body and trailers as sent."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events

GENERATE = b"/pdserve.v1.Generation/Generate"


def frame(body: bytes, compressed: bool = False) -> bytes:
    """One gRPC message: the compressed flag, a 4-byte length, the bytes."""
    return bytes([compressed]) + len(body).to_bytes(4, "big") + body


def grpc_headers(path: bytes = GENERATE, **extra: bytes) -> list[tuple[bytes, bytes]]:
    headers = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path),
        (b":authority", b"localhost"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]
    return headers + [(k.replace("_", "-").encode(), v) for k, v in extra.items()]


@dataclass
class Answer:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytes = b""
    trailers: dict[bytes, bytes] = field(default_factory=dict)
    reset: bool = False

    @property
    def status(self) -> dict[bytes, bytes]:
        """grpc-status and grpc-message, from the trailers or a trailers-only answer."""
        return self.trailers or self.headers


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.h2.initiate_connection()
        self.answers: dict[int, Answer] = {}

    @classmethod
    async def connect(cls, endpoint: str) -> RawClient:
        host, port = endpoint.rsplit(":", 1)
        return cls(*await asyncio.open_connection(host, int(port)))

    async def send(self, headers, data: bytes = b"") -> int:
        """Open a stream: `headers`, then `data` and the end of the request."""
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, headers, end_stream=not data)
        self.answers[stream_id] = Answer()
        while data:  # as flow control allows, reading the server's window updates
            window = self.h2.local_flow_control_window(stream_id)
            room = min(window, self.h2.max_outbound_frame_size)
            if room == 0:
                self.writer.write(self.h2.data_to_send())
                await self._read(stream_id)
                continue
            self.h2.send_data(stream_id, data[:room], end_stream=len(data) <= room)
            data = data[room:]
        self.writer.write(self.h2.data_to_send())
        await self.writer.drain()
        return stream_id

    async def answer(self, stream_id: int, timeout_s: float = 10.0) -> Answer:
        """Read until the stream ends (or is reset)."""
        async with asyncio.timeout(timeout_s):
            while True:
                done = await self._read(stream_id)
                if done:
                    return self.answers[stream_id]

    async def call(self, headers, data: bytes = b"") -> Answer:
        return await self.answer(await self.send(headers, data))

    async def _read(self, stream_id: int) -> bool:
        data = await self.reader.read(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        ended = False
        for event in self.h2.receive_data(data):
            answer = self.answers.get(getattr(event, "stream_id", 0))
            if isinstance(event, h2.events.ResponseReceived):
                answer.headers = dict(event.headers)
            elif isinstance(event, h2.events.DataReceived):
                answer.body += event.data
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.TrailersReceived):
                answer.trailers = dict(event.headers)
            elif isinstance(event, h2.events.StreamReset):
                answer.reset = True
            if isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                ended = ended or event.stream_id == stream_id
        self.writer.write(self.h2.data_to_send())
        return ended

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()
