"""Serve's proxy at the nice value of pdserve's replicas.

pdserve's replicas run at nice 0 (`REPLICA_ENV_VARS`, cluster/serving/app.py); Ray starts every
other worker, Serve's proxies included, at `RAY_worker_niceness` (15 unless the node's
`ray start` set it, as `NODE_ENV_VARS` does). A proxy at 15 beside busy replicas at 0 gets a
sliver of a shared core: with a replacement replica loading after a kill, load through the
proxy collapsed (TTFT p50 10.5 s against 0.18 s, docs/findings.md) while the direct endpoint
was unhurt. The proxy imports the servicer function (router/grpc_ingress.py) as it starts,
which calls `match_replica_niceness`: each thread of the process is moved to nice 0 where the
process may (root, or `CAP_SYS_NICE`), else one warning names the setting to fix.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("ray.serve." + __name__)
REPLICA_NICENESS = 0


def thread_ids() -> list[int]:
    try:
        return [int(entry.name) for entry in os.scandir("/proc/self/task")]
    except OSError:  # not Linux: the process's own value stands for its threads
        return [0]


def match_replica_niceness() -> int:
    """Move every thread of this process above nice 0 to 0 (threads it starts later inherit
    their creator's value). Returns the highest nice value left: 0, or what a thread kept
    because the process may not raise its priority (then logged once)."""
    left = REPLICA_NICENESS
    refused = False
    for tid in thread_ids():
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)
            if nice > REPLICA_NICENESS:
                os.setpriority(os.PRIO_PROCESS, tid, REPLICA_NICENESS)
        except ProcessLookupError:  # the thread ended
            continue
        except PermissionError:
            refused = True
            left = max(left, nice)
    if refused:
        logger.warning(
            "Serve's proxy runs at nice %d below pdserve's replicas at %d and may not leave it; "
            "start each node's Ray with RAY_worker_niceness=%d (cluster/serving/app.py "
            "NODE_ENV_VARS), or a busy engine starves the proxy",
            left,
            REPLICA_NICENESS,
            REPLICA_NICENESS,
        )
    return left
