"""Module loggers sit under Serve's `ray.serve` logger, so a replica's records go through the
handlers Serve gives it (request and replica ids, INFO kept) instead of the root logger's;
the engine replica writes its stats line there."""

from __future__ import annotations

import ast
import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.serving.metered_engine import EngineTotals
from cluster.serving.pool_messages import ReplicaStats
from cluster.serving.replica import EngineReplica
from cluster.serving.stats_line import StatsLine, format_stats_line

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("cluster", "router", "prefill_worker", "decode_worker")
BUSY = ReplicaStats("decode", "d0", 64, 16, 0, running=2, waiting=0, queued_prompt_tokens=0)


def logger_calls() -> dict[str, list[str]]:
    """Each first-party module's `logging.getLogger(...)` arguments, as source text."""
    calls: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "getLogger":
                    args = [ast.unparse(a) for a in node.args]
                    calls.setdefault(str(path.relative_to(ROOT)), []).extend(args)
    return calls


def test_every_module_logger_is_under_ray_serve():
    calls = logger_calls()
    assert "cluster/serving/replica.py" in calls and "router/router.py" in calls
    wrong = {f: args for f, args in calls.items() if args != ["'ray.serve.' + __name__"]}
    assert not wrong, wrong


@pytest.fixture
def serve_handler():
    """Records what reaches a handler on `ray.serve`, set up as Serve sets it up in a replica
    (INFO, not propagated), the root logger at WARNING as in Ray's workers."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    serve, root = logging.getLogger("ray.serve"), logging.getLogger()
    saved = serve.level, serve.propagate, root.level
    serve.setLevel(logging.INFO)
    serve.propagate = False
    root.setLevel(logging.WARNING)
    serve.addHandler(handler)
    yield records
    serve.removeHandler(handler)
    serve.level, serve.propagate = saved[:2]
    root.setLevel(saved[2])


def _replica(totals: EngineTotals) -> EngineReplica:
    async def call(fn):
        return fn(SimpleNamespace(totals=lambda: totals))

    r = object.__new__(EngineReplica)
    r.engine = SimpleNamespace(call=call)
    r.last_stats = BUSY
    r.stats_line = StatsLine("decode", EngineTotals(0.0))
    return r


def test_the_stats_line_reaches_serves_handler_at_info(serve_handler):
    r = _replica(EngineTotals(10.0, generated_tokens=500))
    asyncio.run(r._log_stats())
    [record] = serve_handler
    assert record.name == "ray.serve.cluster.serving.replica"
    assert record.levelno == logging.INFO
    assert record.getMessage() == format_stats_line("decode", 0.0, 50.0, BUSY, 0.0)


def test_the_report_loop_writes_the_line_when_it_is_due(serve_handler):
    r = _replica(EngineTotals(10.0, generated_tokens=500))

    async def report() -> None:
        pass

    r._report = report

    async def one_round() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r._report_loop(), 0.05)

    asyncio.run(one_round())  # the line was due: its interval began at 0.0
    assert [rec.getMessage() for rec in serve_handler] == [
        format_stats_line("decode", 0.0, 50.0, BUSY, 0.0)
    ]
