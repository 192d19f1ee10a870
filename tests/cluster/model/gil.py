"""Whether a native call lets other Python threads run while it computes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def other_thread_wait_s(call: Callable[[], object]) -> tuple[float, float]:
    """Run `call` while another thread waits to run one line of Python: (seconds until that
    thread ran, seconds the call took). A call that holds the GIL keeps the thread waiting to
    its end; one that releases it lets the thread run at once."""
    go = threading.Event()
    ran_at: list[float] = []

    def waiter() -> None:
        go.wait()
        ran_at.append(time.perf_counter())

    thread = threading.Thread(target=waiter)
    thread.start()
    began = time.perf_counter()
    go.set()
    call()
    took = time.perf_counter() - began
    thread.join()
    return ran_at[0] - began, took
