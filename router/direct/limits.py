"""`DirectLimits`: every bound the direct endpoint keeps, in one frozen dataclass, with
grpc core's server as the model (its defaults where it has one; where it has none, a bound
sized for a router replica). `memory_bound_bytes` turns them into the most memory the endpoint
holds for its clients, the figure the hostile-client tests measure against."""

from __future__ import annotations

from dataclasses import dataclass

from router.direct.frame_check import BLOCK_SLACK

# The largest window HTTP/2 allows (RFC 9113, 6.9.1), and a connection's before any update.
MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65535
# What one open stream costs beyond its header list: h2's stream state and its window
# managers, the `GrpcCall` (an upper bound; test_direct_attacks.py measures it).
STREAM_STATE_BYTES = 4 << 10
# How much larger a decoded header list is in Python objects than HPACK counts it (32 bytes of
# overhead per field): a list of many tiny fields is the worst case, two bytes objects and a
# dict entry per field against 37 bytes counted (an upper bound, measured there too).
HEADER_OBJECT_FACTOR = 4
# A connection's own state: h2's connection, HPACK tables, the protocol and asyncio transport.
CONNECTION_STATE_BYTES = 64 << 10
# SETTINGS_MAX_FRAME_SIZE, HTTP/2's default, which the endpoint keeps: a frame that claims more
# is refused (GOAWAY FRAME_SIZE_ERROR) before any of it is buffered (frame_check.py), so h2
# holds at most this and a 9-byte header of a frame not yet whole.
MAX_FRAME_BYTES = 16 << 10
READ_BUFFER_BYTES = 9 + MAX_FRAME_BYTES


@dataclass(frozen=True, slots=True)
class DirectLimits:
    """The direct endpoint's bounds. Sizes in bytes, times in seconds."""

    # Connections open at once; one more is sent GOAWAY (ENHANCE_YOUR_CALM) and closed.
    max_connections: int = 128
    # SETTINGS_MAX_CONCURRENT_STREAMS: one stream more is a protocol error closing the
    # connection. The router's own limit on calls (1,024) is its admission, not this.
    max_streams: int = 256
    # SETTINGS_MAX_HEADER_LIST_SIZE, enforced from the connection's first byte (grpc core's
    # default metadata limit).
    max_header_list_bytes: int = 8 << 10
    # A request message, as grpc's default receive limit: more is RESOURCE_EXHAUSTED.
    max_request_bytes: int = 4 << 20
    # SETTINGS_INITIAL_WINDOW_SIZE: request bytes one stream may send before its call takes
    # them. At least a whole request, else the largest could never arrive.
    stream_window_bytes: int = (4 << 20) + (64 << 10)
    # The connection's receive window: request bytes all its streams may hold together. The
    # window is given back as calls take their requests, so this is the connection's
    # buffered-bytes cap, and HTTP/2 flow control is what holds a client to it.
    connection_window_bytes: int = (4 << 20) + (64 << 10)
    # Bytes queued for a client that does not read (beyond the socket's own buffer): past
    # this the connection is dropped. Responses stop far below it (`pause_writing`); what
    # reaches it is frames h2 answers on its own (PING and SETTINGS acks) to a flood.
    write_buffer_bytes: int = 1 << 20
    # From the connection's start to the client's preface and first SETTINGS (grpc core: 120 s).
    handshake_timeout_s: float = 20.0
    # A connection with no stream open this long is sent GOAWAY and closed.
    idle_timeout_s: float = 300.0
    # From a stream's headers to the end of its request: a body that never ends is refused
    # DEADLINE_EXCEEDED and the stream reset, giving its window back.
    receive_timeout_s: float = 30.0
    # grpc core's ping policy: a PING sooner than `min_ping_interval_s` after the last one is
    # a strike, more than `max_ping_strikes` strikes is GOAWAY (ENHANCE_YOUR_CALM); any
    # HEADERS or DATA the endpoint sends clears them.
    min_ping_interval_s: float = 300.0
    max_ping_strikes: int = 2

    def __post_init__(self) -> None:
        counts = (self.max_connections, self.max_streams, self.max_header_list_bytes)
        if min(counts) < 1 or self.max_ping_strikes < 0:
            raise ValueError("connection, stream and header limits must be >= 1, strikes >= 0")
        if self.max_request_bytes < 1 or self.write_buffer_bytes < 1:
            raise ValueError("max_request_bytes and write_buffer_bytes must be >= 1")
        if not self.max_request_bytes + 5 <= self.stream_window_bytes <= MAX_WINDOW:
            raise ValueError("stream_window_bytes must take a whole request (+5), <= 2^31-1")
        least = max(self.stream_window_bytes, DEFAULT_WINDOW)
        if not least <= self.connection_window_bytes <= MAX_WINDOW:
            raise ValueError("connection_window_bytes must be >= stream_window_bytes, 65,535")
        times = (
            self.handshake_timeout_s,
            self.idle_timeout_s,
            self.receive_timeout_s,
            self.min_ping_interval_s,
        )
        if min(times) <= 0:
            raise ValueError("timeouts and the ping interval must be > 0")

    @property
    def header_block_bytes(self) -> int:
        """The most a header block's frames may claim (frame_check.py): h2 holds them whole."""
        return self.max_header_list_bytes + BLOCK_SLACK

    def connection_bound_bytes(self) -> int:
        """The most one connection holds: its request window, its write buffer, its streams'
        state and header lists, a header block under way, a frame not yet whole, its own
        state."""
        per_stream = STREAM_STATE_BYTES + HEADER_OBJECT_FACTOR * self.max_header_list_bytes
        return (
            self.connection_window_bytes
            + self.write_buffer_bytes
            + self.max_streams * per_stream
            + self.header_block_bytes
            + READ_BUFFER_BYTES
            + CONNECTION_STATE_BYTES
        )

    def memory_bound_bytes(self, connections: int | None = None) -> int:
        """The most the endpoint holds for `connections` clients (default: as many as it
        takes), before any call runs: what a client can pin without the router's admission."""
        return (connections or self.max_connections) * self.connection_bound_bytes()

    @property
    def tick_s(self) -> float:
        """How often a connection checks its timers: a quarter of the shortest."""
        shortest = min(self.handshake_timeout_s, self.idle_timeout_s, self.receive_timeout_s)
        return shortest / 4
