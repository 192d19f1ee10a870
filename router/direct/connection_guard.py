"""`ConnectionGuard`: the time limits and the ping policy of one `GrpcConnection`
(grpc_connection.py), as `DirectLimits` (limits.py) states them.

One timer per connection ticks every `DirectLimits.tick_s` and checks, in turn: the client's
preface and first SETTINGS within `handshake_timeout_s` (else the connection is closed, nothing
sent); each stream's request whole within `receive_timeout_s` of its headers (else that call is
refused DEADLINE_EXCEEDED and its stream reset, which gives its window back); and a connection
with no stream for `idle_timeout_s` (GOAWAY, then closed). A tick per connection rather than a
timer per stream: a client that opens streams by the thousand does not add timers by the
thousand, and each deadline is kept within a quarter of its length.

PINGs follow grpc core's policy: one sooner than `min_ping_interval_s` after the last is a
strike, strikes are cleared whenever the endpoint sends HEADERS or DATA, and one strike more
than `max_ping_strikes` is GOAWAY ENHANCE_YOUR_CALM ("too_many_pings") and the connection's end.
"""

from __future__ import annotations

import asyncio
from typing import Any

from router.direct.limits import DirectLimits


class ConnectionGuard:
    """The timers and the ping strikes of `connection` (a `GrpcConnection`)."""

    def __init__(self, connection: Any, limits: DirectLimits) -> None:
        self.connection = connection
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.started = self.loop.time()
        self.handshaken = False
        self.quiet_since: float | None = self.started  # no stream open since then
        self.last_ping: float | None = None
        self.strikes = 0
        self.timer: asyncio.TimerHandle | None = self.loop.call_later(limits.tick_s, self.tick)

    def handshake_done(self) -> None:
        self.handshaken = True

    def busy(self) -> None:
        """A stream opened."""
        self.quiet_since = None

    def quiet(self) -> None:
        """The last stream closed."""
        if self.quiet_since is None:
            self.quiet_since = self.loop.time()

    def sent(self) -> None:
        """The endpoint sent HEADERS or DATA: pings are expected again."""
        self.strikes = 0

    def ping(self) -> bool:
        """A PING arrived; True when it is one strike too many."""
        now = self.loop.time()
        if self.last_ping is not None and now - self.last_ping < self.limits.min_ping_interval_s:
            self.strikes += 1
        self.last_ping = now
        return self.strikes > self.limits.max_ping_strikes

    def tick(self) -> None:
        self.timer = None
        conn = self.connection
        if conn.closed():
            return
        now = self.loop.time()
        if not self.handshaken:
            if now - self.started >= self.limits.handshake_timeout_s:
                conn.abort("no preface and SETTINGS within the handshake timeout")
                return
        else:
            late = now - self.limits.receive_timeout_s
            for call in [c for c in conn.calls.values() if c.task is None and c.arrived <= late]:
                conn.refuse_unreceived(call)
            idle = self.quiet_since is not None and now - self.quiet_since
            if idle and idle >= self.limits.idle_timeout_s:
                conn.go_away_idle()
                return
        self.timer = self.loop.call_later(self.limits.tick_s, self.tick)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
