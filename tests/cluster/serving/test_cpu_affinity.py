"""Engine cores: parsing, the config field, pinning the engine thread, reserving for Ray."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading

import pytest

from cluster.config import ModelConfig
from cluster.errors import InvalidArgument
from cluster.serving.app_config import AppConfig, PoolConfig
from cluster.serving.cpu_affinity import (
    engine_cores,
    format_cpu_list,
    parse_cpu_list,
    thread_cpus,
)

CORES = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to tell masks apart")


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, ()),
        ("", ()),
        ("3", (3,)),
        (3, (3,)),
        ("0,2-4", (0, 2, 3, 4)),
        (" 5 , 1-2 ,", (1, 2, 5)),
        ([4, 1, 4], (1, 4)),
        ((), ()),
    ],
)
def test_cpu_lists_parse_like_linux_writes_them(value, want) -> None:
    assert parse_cpu_list(value) == want


@pytest.mark.parametrize("bad", ["a", "1-", "3-1", "-1", "1,x", [1, "2"], [-1], True, "0-5000"])
def test_a_bad_cpu_list_is_refused_naming_the_field(bad) -> None:
    with pytest.raises(InvalidArgument, match="engine_cpus"):
        parse_cpu_list(bad)


def test_format_is_the_inverse_of_parse() -> None:
    for text in ["0", "0,2-4", "1-3,7,9-10"]:
        assert format_cpu_list(parse_cpu_list(text)) == text


def test_pool_config_normalizes_and_round_trips_engine_cpus() -> None:
    pool = PoolConfig(engine_cpus="2-3")
    assert pool.engine_cpus == (2, 3)
    app = AppConfig.from_dict(
        {"model": {"path": "m"}, "decode": {"engine_cpus": [5, 4]}, "prefill": {}}
    )
    assert app.decode.engine_cpus == (4, 5)
    assert app.prefill.engine_cpus == ()
    dumped = app.to_dict()
    assert dumped["decode"]["engine_cpus"] == [4, 5]  # plain list: YAML/JSON-safe
    assert AppConfig.from_dict(dumped) == app
    with pytest.raises(InvalidArgument, match="engine_cpus"):
        PoolConfig(engine_cpus="x")


def test_the_router_has_no_engine_to_pin() -> None:
    with pytest.raises(InvalidArgument, match="engine_cpus"):
        AppConfig(model=ModelConfig(path="m"), router=PoolConfig(engine_cpus=(0,)))


@needs_two
def test_threads_started_inside_keep_the_engine_cores_and_the_caller_gets_its_mask_back() -> None:
    before = os.sched_getaffinity(0)
    seen: dict[str, tuple[int, ...]] = {}
    go = threading.Event()

    def worker() -> None:
        seen["inside"] = thread_cpus(threading.get_native_id())
        go.wait(5)
        seen["later"] = thread_cpus(threading.get_native_id())

    with engine_cores((CORES[-1],)) as cores:
        t = threading.Thread(target=worker)
        t.start()
    go.set()
    t.join(5)
    assert cores == (CORES[-1],)
    assert seen == {"inside": (CORES[-1],), "later": (CORES[-1],)}
    assert os.sched_getaffinity(0) == before


def test_no_engine_cpus_pins_nothing() -> None:
    before = os.sched_getaffinity(0)
    with engine_cores(()) as cores:
        assert os.sched_getaffinity(0) == before
    assert cores == ()


def test_cores_this_node_lacks_leave_the_engine_unpinned(caplog) -> None:
    before = os.sched_getaffinity(0)
    absent = (max(CORES) + 1000,)
    with engine_cores(absent) as cores:
        assert os.sched_getaffinity(0) == before
    assert cores == ()
    assert "not usable" in caplog.text


def _reserve(cpus: str) -> subprocess.CompletedProcess:
    """In a child process, so this test process keeps its own mask."""
    code = (
        "import subprocess, sys\n"
        "from cluster.serving.cpu_affinity import parse_cpu_list, reserve_for_engines\n"
        f"rest = reserve_for_engines(parse_cpu_list({cpus!r}))\n"
        # a process started afterwards (as Ray's would be) inherits the reduced mask
        "child = subprocess.run([sys.executable, '-c',"
        " 'import os; print(sorted(os.sched_getaffinity(0)))'], capture_output=True, text=True)\n"
        "print(list(rest), child.stdout.strip())\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@needs_two
def test_reserving_moves_the_starting_process_and_its_children_off_the_engine_cores() -> None:
    done = _reserve(str(CORES[-1]))
    assert done.returncode == 0, done.stderr
    rest = CORES[:-1]
    assert done.stdout.split("] ")[0] + "]" == str(rest)
    assert done.stdout.strip().endswith(str(rest))


def test_reserving_every_core_or_a_missing_one_is_refused() -> None:
    every = _reserve(format_cpu_list(CORES))
    assert every.returncode != 0 and "leave at least one" in every.stderr
    missing = _reserve(str(max(CORES) + 1000))
    assert missing.returncode != 0 and "not available here" in missing.stderr


def test_serve_flags_give_both_engine_pools_the_cores() -> None:
    from cluster.cli.serve import _config_from_flags, add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    config = _config_from_flags(p.parse_args(["--engine-cpus", "1-2"]))
    assert config.prefill.engine_cpus == (1, 2)
    assert config.decode.engine_cpus == (1, 2)
    assert not hasattr(config.router, "engine_cpus")  # the router has no engine settings
    assert _config_from_flags(p.parse_args([])).decode.engine_cpus == ()
