"""Cores reserved for engine threads (`PoolConfig.engine_cpus`).

On a CPU node the engine thread is the work: every step is one core's worth of matrix-vector
products. When Ray's own processes (GCS, raylet, the Serve controller and proxy, the router,
idle replicas' background loops) are free to run on the same cores, the scheduler keeps
interrupting the step for them, and each token pays for it. Reserving cores splits the node:
the engine threads run only on `engine_cpus`, everything else only on the other cores.

Two halves make that split:
- `reserve_for_engines`: the process that starts Ray moves itself off the engine cores first,
  so every process Ray starts inherits that mask (`pdserve serve --engine-cpus`, or
  `taskset -c REST ray start ...` on a cluster node).
- `engine_cores`: an engine replica creates its engine and starts the engine thread inside
  this context; the thread (and the torch threads it creates) inherit the engine cores, while
  the replica's other threads keep the process mask. Linux lets a thread widen its own mask
  beyond its parent's, within its cpuset, without privileges.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterable, Iterator

from cluster.errors import InvalidArgument

log = logging.getLogger("ray.serve." + __name__)

MAX_CPU = 4095  # far above any node; a bound so a typo cannot build a huge set


def parse_cpu_list(value: str | int | Iterable[int] | None) -> tuple[int, ...]:
    """Cores from a Linux cpu list ("2", "0,2-3"), an int or a list of ints; () for none."""
    if value is None:
        return ()
    if isinstance(value, bool):
        raise InvalidArgument(f"engine_cpus: not a cpu list: {value!r}")
    if isinstance(value, int):
        items: list[int] = [value]
    elif isinstance(value, str):
        items = []
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            try:
                first, last = (int(lo), int(hi)) if sep else (int(lo), int(lo))
            except ValueError:
                raise InvalidArgument(f"engine_cpus: not a cpu list: {value!r}") from None
            if last < first:
                raise InvalidArgument(f"engine_cpus: empty range {part!r}")
            if last > MAX_CPU:
                raise InvalidArgument(f"engine_cpus: core {last} is above {MAX_CPU}")
            items.extend(range(first, last + 1))
    else:
        items = list(value)
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in items):
            raise InvalidArgument(f"engine_cpus: cores must be integers, got {value!r}")
    for c in items:
        if not 0 <= c <= MAX_CPU:
            raise InvalidArgument(f"engine_cpus: core {c} is not in 0..{MAX_CPU}")
    return tuple(sorted(set(items)))


def cpu_list_arg(text: str) -> tuple[int, ...]:
    """`parse_cpu_list` as an argparse `type`: a bad list is a usage error."""
    try:
        return parse_cpu_list(text)
    except InvalidArgument as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The Linux cpu list form of `cpus`: (0, 2, 3, 4) -> "0,2-4"."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(c)
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def reserve_for_engines(engine_cpus: tuple[int, ...]) -> tuple[int, ...]:
    """Move the calling thread (and so every process it starts from now on) off `engine_cpus`;
    return the cores left to it. Call before starting Ray, from the thread that starts it."""
    available = os.sched_getaffinity(0)
    missing = set(engine_cpus) - available
    if missing:
        raise InvalidArgument(
            f"engine_cpus {format_cpu_list(missing)} not available here "
            f"(this process may run on {format_cpu_list(available)})"
        )
    rest = available - set(engine_cpus)
    if not rest:
        raise InvalidArgument(
            "engine_cpus takes every core: leave at least one for Ray's processes and the router"
        )
    os.sched_setaffinity(0, rest)
    return tuple(sorted(rest))


@contextlib.contextmanager
def engine_cores(engine_cpus: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Pin the calling thread to `engine_cpus` for the block, then restore its mask: threads
    started inside (the engine thread, torch's pool) keep the engine cores. Yields the cores
    actually used: () when none are configured or none of them exists on this node (logged;
    the engine then runs unpinned rather than not at all)."""
    if not engine_cpus:
        yield ()
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, engine_cpus)
    except OSError as e:  # EINVAL: none of these cores is in this node's cpuset
        log.warning("engine_cpus %s not usable here (%s); not pinning", engine_cpus, e)
        yield ()
        return
    try:
        yield tuple(sorted(os.sched_getaffinity(0)))
    finally:
        os.sched_setaffinity(0, before)


def thread_cpus(native_id: int) -> tuple[int, ...]:
    """The cores a thread of this process may run on."""
    return tuple(sorted(os.sched_getaffinity(native_id)))
