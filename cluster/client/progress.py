"""`Progress`: a one-line account of a replay on stderr (requests done, failed, in flight,
seconds), so a trace that replays for minutes shows it is moving. On a terminal the line is
redrawn in place at most every `interval_s`; elsewhere (a CI log, a pipe) a line is printed
every tenth of the requests, so the log stays short."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24


class Progress:
    """Counts a replay of `total` requests. The load generator calls `sent` as a request goes
    out and `done` when it ends; `close` prints the last line. Disabled, it prints nothing."""

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        enabled: bool = True,
        interval_s: float = 0.2,
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and total > 0
        self.tty = self.enabled and self.stream.isatty()
        self.interval_s = interval_s
        self.in_flight = self.completed = self.failed = 0
        self.began = time.perf_counter()
        self._drawn_at = -float("inf")
        self._step = max(1, total // 10)

    def sent(self) -> None:
        self.in_flight += 1
        self._draw()

    def done(self, ok: bool) -> None:
        self.in_flight -= 1
        self.completed += ok
        self.failed += not ok
        ended = self.completed + self.failed
        self._draw(force=not self.tty and (ended % self._step == 0 or ended == self.total))

    def close(self) -> None:
        if self.tty:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def line(self) -> str:
        ended = self.completed + self.failed
        filled = BAR_WIDTH * ended // self.total if self.total else BAR_WIDTH
        return (
            f"bench [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {ended}/{self.total} done "
            f"({self.failed} failed), {self.in_flight} in flight, "
            f"{time.perf_counter() - self.began:.1f} s"
        )

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty and (force or now - self._drawn_at >= self.interval_s):
            self.stream.write("\r" + self.line())
        elif not self.tty and force:
            self.stream.write(self.line() + "\n")
        else:
            return
        self._drawn_at = now
        self.stream.flush()
