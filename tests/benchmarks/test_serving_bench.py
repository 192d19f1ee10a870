"""Smoke test of the serving benchmark: `--quick` on the session's Ray and Serve (tiny model).

It checks that every row of the report is there with a positive number, not the targets: a
2-core test machine says nothing about them (the full run's report is in
benchmarks/results/).
"""

from __future__ import annotations

import re

import pytest

from benchmarks import serving_bench
from tests.benchmarks.bench_report import cells

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _positive(cell: str) -> float:
    m = _NUMBER.search(cell)
    assert m is not None, f"no number in {cell!r}"
    return float(m.group())


def test_quick_run_reports_every_row_with_positive_numbers(ray_serve):
    report = serving_bench.main(["--quick", "--grpc-port", str(ray_serve.grpc_port)])

    labels = serving_bench.LABELS.values()
    absolute = [f"decode per token, {label}, via Serve + gRPC" for label in labels]
    alone = [f"decode per token, {label}: its replica's engine alone" for label in labels]
    for label in (*absolute, *alone, *serving_bench.ROWS):
        assert _positive(cells(report, label)[0]) > 0, label
    for label in labels:  # differences: any sign
        _positive(cells(report, f"added per token, {label}")[0])
        _positive(cells(report, f"added per token, {label}, vs its replica's engine alone")[0])
        _positive(
            cells(report, f"this process's engine − the {label} replica's engine, both alone")[0]
        )
        # the decoding engine thread, from its schedstat (this session's Ray is ours)
        served = cells(report, f"{label}, served")
        assert _positive(served[0]) > 0 and _positive(served[1]) >= 0, served
        assert _positive(cells(report, f"{label}, its engine alone")[0]) > 0

    # CPU per token by process: served, with the serving path idle, and what serving cost
    # (/proc counts 10 ms ticks: a short run's router or proxy may show 0)
    for process in ("Router", "proxy", "Decode"):
        served, idle, cost = cells(report, process)[:3]
        assert _positive(served) >= 0 and _positive(idle) >= 0, (process, served, idle)
        _positive(cost)
    assert _positive(cells(report, "Decode")[0]) > 0

    _, cfg = serving_bench.parse_args(["--quick"])
    for n_tok in cfg.long_prompts:
        mb, ms, gbs = (_positive(c) for c in cells(report, str(n_tok))[:3])
        assert mb > 0 and ms > 0 and gbs > 0
        ttft_row = [c for c in report.splitlines() if c.startswith(f"| {n_tok} |")][1]
        values = [_positive(c) for c in ttft_row.strip("|").split("|")[1:]]
        assert len(values) == 7 and all(v > 0 for v in values), ttft_row

    verdicts = ("| PASS |", "| FAIL |", "| NOT SHOWN |")
    targets = [line for line in report.splitlines() if line.endswith(verdicts)]
    # per mode: two direct comparisons and the engine thread's own accounting
    assert len(targets) == 2 * 3 + 2 * len(cfg.long_prompts), targets
    assert "serving's cost to the disaggregated engine thread" in report
    assert "load average before" in report and "torch thread(s)" in report
    # The session's Ray was started as `pdserve serve` starts one: its proxy has NODE_ENV_VARS.
    assert "proxy to router: over gRPC to the router's replica" in report


def test_a_replica_times_its_engine_alone_and_refuses_when_busy_or_asked_wrong(ray_serve):
    """`time_decode` on a real replica: its numbers, its refusals, and nothing left behind."""
    from ray import serve

    from cluster.errors import InvalidArgument, Unavailable
    from cluster.request import Request
    from cluster.sampling_params import SamplingParams
    from tests.ray_fixtures import deploy, small_app_config, wait_for_idle

    # The serving bench's quick model is built by the smoke test above or here.
    _, cfg = serving_bench.parse_args(["--quick"])
    serving_bench._ensure_model(cfg)
    deploy(small_app_config(str(cfg.model_dir), mode="colocated"), "timed", "/timed")
    try:
        handle = serve.get_deployment_handle("Colocated", app_name="timed")
        wall, cpu = handle.time_decode.remote(list(range(20, 36)), 8).result()
        assert 0 < wall < 5 and 0 < cpu < 5
        with pytest.raises(InvalidArgument, match="max_tokens"):
            handle.time_decode.remote([20, 21], 2).result()
        with pytest.raises(InvalidArgument):  # the engine's own prompt check
            handle.time_decode.remote([], 8).result()
        # Busy: a streaming request holds the engine while time_decode asks.
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        stream = handle.options(stream=True).generate.remote(
            Request("busy", tuple(range(20, 36)), params)
        )
        next(iter(stream))
        with pytest.raises(Unavailable, match="idle"):
            handle.time_decode.remote(list(range(20, 36)), 8).result()
        stream.cancel()
        wait_for_idle(ray_serve, "timed", {"colocated"})
    finally:
        serve.delete("timed")


def test_engine_cpus_reach_the_engine_pools_and_need_a_ray_of_its_own(capsys) -> None:
    _, cfg = serving_bench.parse_args(["--quick", "--engine-cpus", "1"])
    app = serving_bench.app_config(cfg)
    assert (app.prefill.engine_cpus, app.decode.engine_cpus, app.router.engine_cpus) == (
        (1,),
        (1,),
        (),
    )
    assert "engine threads" in serving_bench._cores(cfg)
    for bad in (["--engine-cpus", "x"], ["--engine-cpus", "1", "--grpc-port", "9000"]):
        with pytest.raises(SystemExit):
            serving_bench.parse_args(bad)
        assert "engine" in capsys.readouterr().err


def test_the_engine_threads_cost_is_its_extra_time_off_cpu_plus_its_loop_work() -> None:
    res = serving_bench.Results(cfg=None, app=None)  # type: ignore[arg-type]
    # served: on CPU 60, waiting 0.2, otherwise off 0.1; alone: wall 60.1, CPU 60 (ms)
    res.engine_thread_s["disaggregated"] = [(60e-3, 0.2e-3, 0.1e-3), (61e-3, 0.0, 0.0)]
    res.alone_s["disaggregated"] = [60.1e-3, 59e-3]
    res.alone_cpu_s["disaggregated"] = [60e-3, 58.9e-3]
    res.loop_cpu_s["disaggregated"] = [0.05e-3, 0.02e-3]
    lost = serving_bench.lost_by_engine(res, "disaggregated")
    assert lost == pytest.approx([0.25e-3, -0.08e-3])
    assert serving_bench._thread_modes(res) == ["disaggregated"]
    res.loop_cpu_s["disaggregated"].pop()  # a run without the reading: no table from it
    assert serving_bench._thread_modes(res) == []


def test_the_median_interval_is_the_binomial_order_statistics() -> None:
    xs = [0.5, -1.0, 3.0, 2.0, 1.0, 0.0, 4.0, 6.0, 5.0]  # sorted: -1, 0, 0.5, 1, 2, 3, 4, 5, 6
    low, high, coverage = serving_bench.median_ci(xs)
    # n = 9: P(B <= 1) = 10/512, so x(2)..x(8) covers 1 - 20/512 = 96.1% (x(3)..x(7): 82%)
    assert (low, high) == (0.0, 5.0)
    assert coverage == pytest.approx(1 - 20 / 512)
    assert serving_bench.median_ci([3.0, 1.0]) == (1.0, 3.0, 0.5)  # too few: min..max
    low, high, coverage = serving_bench.median_ci([float(i) for i in range(25)])
    assert (low, high) == (7.0, 17.0) and coverage >= 0.95


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [(-0.5e-3, 0.9e-3, "PASS"), (1.1e-3, 3e-3, "FAIL"), (0.2e-3, 2e-3, "NOT SHOWN")],
)
def test_an_interval_straddling_the_target_is_not_called_either_way(low, high, verdict) -> None:
    assert serving_bench._bounded_verdict(low, high, 1e-3) == verdict
