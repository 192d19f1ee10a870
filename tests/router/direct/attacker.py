"""The attacks of test_direct_attacks.py, run as a process of their own so that the test's
measure of its memory counts the endpoint's alone. Prints one JSON line of what it saw.

    python -m tests.router.direct.attacker streams HOST:PORT CONNECTIONS STREAMS REQUEST_BYTES
    python -m tests.router.direct.attacker pings HOST:PORT COUNT

`streams`: on each connection, `STREAMS` gRPC calls whose request body is announced as
`REQUEST_BYTES` and never ends, fed as far as the server's windows let (an h2 client: it keeps
to flow control); then reads until the server closes the connection. `pings`: PING frames as
fast as the socket takes them, reading nothing, then reads to the end.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from tests.router.direct.wire import Wire, goaway, ping

HEADERS = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/pdserve.v1.Generation/Generate"),
    (b":authority", b"localhost"),
    (b"content-type", b"application/grpc"),
    (b"te", b"trailers"),
]


async def never_ending(endpoint: str, streams: int, request_bytes: int) -> dict:
    host, port = endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding=None))
    conn.initiate_connection()
    left: dict[int, int] = {}  # stream -> body bytes it may still send
    for _ in range(streams):
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, HEADERS)
        conn.send_data(stream, b"\0" + request_bytes.to_bytes(4, "big"))
        left[stream] = request_bytes - 1  # never the last byte: the body never ends
    sent = reset = 0
    code = None
    start = time.monotonic()
    while True:
        for stream, n in list(left.items()) if code is None else []:
            room = min(n, conn.local_flow_control_window(stream), conn.max_outbound_frame_size)
            if room <= 0:
                continue
            try:
                conn.send_data(stream, b"\0" * room)
            except h2.exceptions.StreamClosedError:  # the server ended it: nothing more to feed
                left.pop(stream)
                continue
            left[stream] -= room
            sent += room
        writer.write(conn.data_to_send())
        try:
            data = await reader.read(65536)
        except ConnectionError:
            data = b""
        if not data:
            break
        if code is not None:
            continue  # after GOAWAY, h2 refuses frames; the rest is read only to see the close
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.StreamReset):
                left.pop(event.stream_id, None)
                reset += 1
            elif isinstance(event, h2.events.ConnectionTerminated):
                code = int(event.error_code)  # GOAWAY: send nothing more, read to the end
    writer.close()
    return {"sent": sent, "reset": reset, "goaway": code, "open_s": time.monotonic() - start}


async def streams(endpoint: str, connections: int, per: int, request_bytes: int) -> dict:
    results = await asyncio.gather(
        *(never_ending(endpoint, per, request_bytes) for _ in range(connections))
    )
    return {"connections": results}


async def pings(endpoint: str, count: int) -> dict:
    wire = await Wire.connect(endpoint)
    flood = b"".join(ping(n) for n in range(count))
    start = time.monotonic()
    wire.send(flood)
    try:
        await wire.writer.drain()
    except ConnectionError:
        pass
    frames = await wire.until_closed(timeout_s=30)
    calm = goaway(frames)
    await wire.close()
    return {
        "goaway": None if calm is None else calm.error_code,
        "debug": None if calm is None else calm.additional_data.decode(),
        "acks": sum(1 for f in frames if type(f).__name__ == "PingFrame"),
        "closed_s": time.monotonic() - start,
    }


def main(argv: list[str]) -> None:
    kind, endpoint, *numbers = argv
    n = [int(x) for x in numbers]
    run = streams(endpoint, *n) if kind == "streams" else pings(endpoint, *n)
    print(json.dumps(asyncio.run(run)))


if __name__ == "__main__":
    main(sys.argv[1:])
