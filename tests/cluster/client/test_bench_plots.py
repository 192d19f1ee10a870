from __future__ import annotations

import pytest

from cluster.client import bench_plots
from cluster.client.bench_plots import EXTRA_HINT, missing_extra, write_plots
from tests.cluster.client.recorded import REPLICAS, recorded_run

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_recorded_run_becomes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_plots(recorded_run(), tmp_path / "plots", REPLICAS, "test run")
    names = ["ttft_cdf.png", "itl_cdf.png", "latency_over_time.png", "phases.png", "replicas.png"]
    assert [p.name for p in paths] == names
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(PNG) and 5_000 < len(data) < 200_000, (p.name, len(data))


def test_without_the_servers_timing_or_pool_sizes_those_plots_are_left_out(tmp_path):
    pytest.importorskip("matplotlib")
    records = recorded_run()
    for r in records:
        r.timing = None  # an OpenAI server other than pdserve
    paths = write_plots(records, tmp_path)
    assert sorted(p.name for p in paths) == ["itl_cdf.png", "latency_over_time.png",
                                             "ttft_cdf.png"]  # fmt: skip


def test_a_missing_matplotlib_is_named_with_its_extra(monkeypatch):
    monkeypatch.setattr(bench_plots.importlib.util, "find_spec", lambda name: None)
    assert missing_extra() == EXTRA_HINT
    assert "pip install 'pdserve[plot]'" in EXTRA_HINT and "\n" not in EXTRA_HINT
