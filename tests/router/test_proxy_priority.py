"""Serve's proxy leaves Ray's worker nice value for the replicas' (router/proxy_priority.py)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading

import pytest

from router import proxy_priority


def _renice_child(results) -> None:
    os.nice(15 - os.nice(0))  # this thread at 15, as Ray starts a worker
    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (started.set(), stop.wait()))
    worker.start()  # inherits 15
    started.wait()
    before = sorted(os.getpriority(os.PRIO_PROCESS, t) for t in proxy_priority.thread_ids())
    left = proxy_priority.match_replica_niceness()
    after = sorted(os.getpriority(os.PRIO_PROCESS, t) for t in proxy_priority.thread_ids())
    stop.set()
    worker.join()
    results.put((before, left, after))


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a thread's priority needs root here")
def test_every_thread_of_a_process_at_nice_15_moves_to_0():
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_renice_child, args=(results,))
    child.start()
    before, left, after = results.get(timeout=60)
    child.join(timeout=30)
    assert before == [15, 15] and left == 0 and after == [0, 0]


def test_a_process_that_may_not_leave_its_nice_value_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(proxy_priority, "thread_ids", lambda: [101, 102, 103])
    monkeypatch.setattr(os, "getpriority", lambda _which, tid: {101: 15, 102: 15, 103: 0}[tid])
    calls = []

    def refuse(_which, tid, value):
        calls.append((tid, value))
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    with caplog.at_level(logging.WARNING, logger=proxy_priority.logger.name):
        assert proxy_priority.match_replica_niceness() == 15
    assert calls == [(101, 0), (102, 0)]  # the thread already at 0 is left alone
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RAY_worker_niceness=0" in warnings[0]


def test_a_thread_that_ends_meanwhile_is_skipped(monkeypatch):
    monkeypatch.setattr(proxy_priority, "thread_ids", lambda: [7])

    def gone(_which, _tid):
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(os, "getpriority", gone)
    assert proxy_priority.match_replica_niceness() == 0
