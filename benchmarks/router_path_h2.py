"""`router_path_bench`'s measure of the design step left for the default stream: a bare
server-streaming `Generate` written straight onto HTTP/2, each engine step's messages for every
stream of a connection framed into one socket write, where grpc.aio makes a `sendmsg` per
message. A prototype for measurement only (no TLS, no deadlines, request headers not decoded,
one request message per stream), served to the same grpc.aio client as the other
configurations, which checks every stream's tokens and finish status.

HTTP/2 as RFC 9113 has it: the client's preface, SETTINGS (acknowledged), PING (answered),
WINDOW_UPDATE (the connection's and each stream's send window respected: what a window does not
allow waits for the client's next update), RST_STREAM (the stream is dropped); the response is
HEADERS (`:status` 200, `content-type` application/grpc), one DATA frame per gRPC message, and
trailers carrying `grpc-status` 0.
"""

from __future__ import annotations

import asyncio
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
INITIAL_WINDOW = 65_535
MAX_FRAME = 1 << 20  # refuse larger frames from the client

# HPACK (RFC 7541): ":status: 200" is static entry 8; "content-type" static entry 31 as a
# literal without indexing; "grpc-status" a literal with a new name. No Huffman coding.
RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + bytes([16]) + b"application/grpc"
TRAILERS = b"\x00" + bytes([11]) + b"grpc-status" + bytes([1]) + b"0"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """A frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    head = len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big")
    return head + payload


class Stream:
    def __init__(self, stream_id: int, window: int) -> None:
        self.id = stream_id
        self.window = window
        self.request = b""
        self.tokens = 0  # still to send
        self.sent = 0
        self.pending: list[bytes] = []  # DATA payloads a window held back


class Connection(asyncio.Protocol):
    def __init__(self, connections: set[Connection]) -> None:
        self.connections = connections  # the server's open connections, this one among them
        self.buffer = b""
        self.preface = False
        self.window = INITIAL_WINDOW  # the connection's send window
        self.initial = INITIAL_WINDOW  # a new stream's send window (the client's SETTINGS)
        self.streams: dict[int, Stream] = {}
        self.out: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.connections.add(self)
        transport.write(frame(SETTINGS, 0, 0))

    def connection_lost(self, exc) -> None:
        self.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.preface:
            if len(self.buffer) < len(PREFACE):
                return
            if not self.buffer.startswith(PREFACE):
                self.transport.close()
                return
            self.buffer, self.preface = self.buffer[len(PREFACE) :], True
        while len(self.buffer) >= 9:
            length = int.from_bytes(self.buffer[:3], "big")
            if length > MAX_FRAME:
                self.transport.close()
                return
            if len(self.buffer) < 9 + length:
                break
            kind, flags = self.buffer[3], self.buffer[4]
            stream = int.from_bytes(self.buffer[5:9], "big") & 0x7FFF_FFFF
            payload, self.buffer = self.buffer[9 : 9 + length], self.buffer[9 + length :]
            self.on_frame(kind, flags, stream, payload)
        self.flush()

    def on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            for i in range(0, len(payload) - 5, 6):
                key, value = struct.unpack(">HI", payload[i : i + 6])
                if key == 0x4:  # SETTINGS_INITIAL_WINDOW_SIZE
                    for s in self.streams.values():
                        s.window += value - self.initial
                    self.initial = value
            self.out.append(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self.out.append(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE and len(payload) == 4:
            increment = int.from_bytes(payload, "big") & 0x7FFF_FFFF
            if stream == 0:
                self.window += increment
            elif stream in self.streams:
                self.streams[stream].window += increment
            self.send_pending()
        elif kind == HEADERS:
            self.streams[stream] = Stream(stream, self.initial)
        elif kind == DATA and stream in self.streams:
            s = self.streams[stream]
            s.request += payload
            if payload:  # give the client its window back at once
                grant = len(payload).to_bytes(4, "big")
                self.out += [
                    frame(WINDOW_UPDATE, 0, 0, grant),
                    frame(WINDOW_UPDATE, 0, stream, grant),
                ]
            if flags & END_STREAM:
                self.start(s)
        elif kind == RST_STREAM:
            self.streams.pop(stream, None)
        elif kind == GOAWAY:
            self.transport.close()

    def start(self, s: Stream) -> None:
        from cluster.pb.pdserve.v1 import generation_pb2 as pb

        message = pb.GenerateRequest.FromString(s.request[5:])  # after gRPC's 5-byte prefix
        s.tokens = message.sampling.max_tokens
        self.out.append(frame(HEADERS, END_HEADERS, s.id, RESPONSE_HEADERS))

    def step(self, make) -> None:
        """One engine step: the next message of every stream, framed into one write."""
        for s in list(self.streams.values()):
            if not s.tokens:
                continue
            body = make(s.sent)
            s.pending.append(b"\x00" + len(body).to_bytes(4, "big") + body)
            s.sent += 1
            s.tokens -= 1
        self.send_pending()
        self.flush()

    def send_pending(self) -> None:
        for s in list(self.streams.values()):
            while s.pending and len(s.pending[0]) <= min(self.window, s.window):
                data = s.pending.pop(0)
                self.window -= len(data)
                s.window -= len(data)
                self.out.append(frame(DATA, 0, s.id, data))
            if not s.pending and not s.tokens and s.sent:
                self.out.append(frame(HEADERS, END_HEADERS | END_STREAM, s.id, TRAILERS))
                del self.streams[s.id]

    def flush(self) -> None:
        if self.out:
            self.transport.write(b"".join(self.out))
            self.out = []


def h2_alone(ready, step_s: float) -> None:
    from benchmarks.router_path_servers import FIRST_TOKEN, run_loop
    from cluster.pb.pdserve.v1 import generation_pb2 as pb

    def make(i: int) -> bytes:
        return pb.GenerateResponse(token_ids=[FIRST_TOKEN + i], text=f"<{i}>").SerializeToString()

    async def main() -> None:
        connections: set[Connection] = set()
        loop = asyncio.get_running_loop()
        listener = await loop.create_server(lambda: Connection(connections), "127.0.0.1", 0)
        ready.put(f"127.0.0.1:{listener.sockets[0].getsockname()[1]}")
        while True:
            await asyncio.sleep(step_s)
            for conn in list(connections):
                conn.step(make)

    run_loop(main())
