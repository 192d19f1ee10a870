"""`FrameCheck`: what a `GrpcConnection` (grpc_connection.py) checks of a client's bytes before
`h2` sees them, from the 9-byte frame headers alone (RFC 9113, 4.1):
- the first frame after the client preface is SETTINGS (3.4), else PROTOCOL_ERROR: h2 would
  serve streams before it;
- no frame claims more than the SETTINGS_MAX_FRAME_SIZE the endpoint advertises (4.2), else
  FRAME_SIZE_ERROR, before a byte of its payload is buffered: h2 checks a frame's length only
  once it holds the whole frame, which may claim up to 16 MiB;
- a header block (HEADERS or PUSH_PROMISE and the CONTINUATION frames after it, to
  END_HEADERS) claims at most `max_header_block` bytes, else ENHANCE_YOUR_CALM: h2 buffers a
  block's frames until its end (up to 64 CONTINUATION frames, 1 MiB) before its decoder sees
  the header list's size. An encoded list is never longer than its SETTINGS size (each field
  counts 32 bytes more than its name and value, far above its encoding's overhead), so the
  bound is the list's limit and room for padding and a priority.

An incremental parser, cheap on the hot path: it keeps the bytes still to come of the preface
or of the frame under way, and a header cut across reads (at most 8 bytes), never a payload;
per read it costs a few integer operations for each frame header the read holds. The
preface's bytes are skipped, not compared: h2 checks them.
"""

from __future__ import annotations

from h2.errors import ErrorCodes

PREFACE_BYTES = 24  # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADER_BYTES = 9
HEADERS, SETTINGS, PUSH_PROMISE, CONTINUATION = 0x1, 0x4, 0x5, 0x9
BLOCK_FRAMES = (HEADERS, PUSH_PROMISE, CONTINUATION)
END_HEADERS = 0x4
BLOCK_SLACK = 256 + 5  # a HEADERS frame's padding (its length byte, up to 255) and priority


class FrameCheck:
    """The frame headers of one connection's bytes, read by read (`check`)."""

    def __init__(self) -> None:
        self.skip = PREFACE_BYTES  # bytes of the preface or of a frame's payload still to come
        self.head = b""  # the start of a frame header cut across reads
        self.first = True  # the next frame is the first after the preface
        self.block = 0  # bytes claimed so far by the header block under way (0: none)

    def check(
        self, data: bytes, max_frame_size: int, max_header_block: int
    ) -> tuple[int, ErrorCodes] | None:
        """None if every frame header in `data` (the connection's next read) passes; else the
        offset in `data` of the first header that fails (0 if it began in an earlier read:
        the bytes before it may go to h2) and the connection error it is."""
        limits = (max_frame_size, max_header_block)
        at, end = self.skip, len(data)
        if self.head and at < end:  # (nothing to skip while a header is cut)
            head = self.head + data[: HEADER_BYTES - len(self.head)]
            if len(head) < HEADER_BYTES:
                self.head = head
                return None
            at = HEADER_BYTES - len(self.head)
            self.head = b""
            length = head[0] << 16 | head[1] << 8 | head[2]
            if (error := self._error(length, head[3], head[4], *limits)) is not None:
                return 0, error
            at += length
        while at + HEADER_BYTES <= end:
            length = data[at] << 16 | data[at + 1] << 8 | data[at + 2]
            kind = data[at + 3]
            if length > max_frame_size or self.first or kind in BLOCK_FRAMES:
                if (error := self._error(length, kind, data[at + 4], *limits)) is not None:
                    return at, error
            at += HEADER_BYTES + length
        if at < end:
            self.head, self.skip = bytes(data[at:]), 0
        else:
            self.skip = at - end
        return None

    def _error(
        self, length: int, kind: int, flags: int, max_frame_size: int, max_header_block: int
    ) -> ErrorCodes | None:
        if self.first:
            self.first = False
            if kind != SETTINGS:
                return ErrorCodes.PROTOCOL_ERROR
        if length > max_frame_size:
            return ErrorCodes.FRAME_SIZE_ERROR
        if kind in BLOCK_FRAMES:
            self.block = self.block + length if kind == CONTINUATION else length
            if self.block > max_header_block:
                return ErrorCodes.ENHANCE_YOUR_CALM
            if flags & END_HEADERS:
                self.block = 0
        return None
