"""The paired quantities the serving benchmark reads off its runs."""

from __future__ import annotations

import pytest

from benchmarks.serving_results import Results, lost_by_engine, thread_modes


def test_the_engine_threads_cost_is_its_extra_time_off_cpu_plus_its_loop_work() -> None:
    res = Results(cfg=None, app=None)  # type: ignore[arg-type]
    # served: on CPU 60, waiting 0.2, otherwise off 0.1; alone: wall 60.1, CPU 60 (ms)
    res.engine_thread_s["disaggregated"] = [(60e-3, 0.2e-3, 0.1e-3), (61e-3, 0.0, 0.0)]
    res.alone_s["disaggregated"] = [60.1e-3, 59e-3]
    res.alone_cpu_s["disaggregated"] = [60e-3, 58.9e-3]
    res.loop_cpu_s["disaggregated"] = [0.05e-3, 0.02e-3]
    lost = lost_by_engine(res, "disaggregated")
    assert lost == pytest.approx([0.25e-3, -0.08e-3])
    assert thread_modes(res) == ["disaggregated"]
    res.loop_cpu_s["disaggregated"].pop()  # a run without the reading: no table from it
    assert thread_modes(res) == []
