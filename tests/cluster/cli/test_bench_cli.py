"""`pdserve bench` end to end in one process, against a fake OpenAI server (the real pdserve,
over gRPC and HTTP, is in tests/e2e/test_bench.py): strict JSON with the run's metadata,
`--save-detailed`, `--plot`, the progress line, and bad options refused before any request."""

from __future__ import annotations

import json

import pytest

from cluster.cli import bench as bench_cli
from cluster.cli.main import main
from cluster.cli.version import package_version
from cluster.client.workload import TRACES, load_trace
from tests.cluster.client.fake_openai_server import MODEL, fake_openai_server
from tests.traces import SHARED_PREFIX_TRACE, write_trace


def refuse(constant: str):
    raise ValueError(f"not strict JSON: {constant}")


def bench(capsys, *args: str) -> tuple[dict, str]:
    assert main(["bench", *args]) == 0
    out = capsys.readouterr()
    return json.loads(out.out, parse_constant=refuse), out.err


def test_json_is_strict_and_carries_the_runs_metadata(capsys, tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", SHARED_PREFIX_TRACE)
    with fake_openai_server() as (url, _):
        out, err = bench(
            capsys, "--backend", "openai", "--base-url", url, "--trace", str(trace),
            "--time-scale", "0.01", "--seed", "5", "--max-concurrency", "3", "--json",
            "--goodput", "ttft:1000", "e2el:5000",
        )  # fmt: skip
    assert (out["backend"], out["target"], out["model_id"]) == ("openai", url, MODEL)
    assert out["pdserve_version"] == package_version() and out["date"].endswith("+00:00")
    assert (out["seed"], out["max_concurrency"], out["request_rate"]) == (5, 3, None)
    w = out["workload"]
    assert (w["kind"], w["trace"], w["length_scale"], w["time_scale"]) == (
        "trace", str(trace), 1 / 32, 0.01
    )  # fmt: skip
    assert "trace of 6 requests" in w["description"] and w["vocab_size"] == 512
    assert out["goodput"] == {"ttft_ms": 1000.0, "e2el_ms": 5000.0}
    assert out["completed"] == out["num_prompts"] == 6 and out["failed"] == 0
    assert out["total_output_tokens"] == sum(m for _, _, m, _ in SHARED_PREFIX_TRACE)
    assert out["request_goodput"] == pytest.approx(out["request_throughput"])
    assert out["mean_ttft_ms"] > 0 and out["p99_itl_ms"] > 0 and out["median_e2el_ms"] > 0
    assert out["dominant_phase"] in out["phases_mean_s"]  # the fake sends pdserve_timing
    assert "6/6 done (0 failed)" in err  # the progress line


def test_save_detailed_and_plot_write_the_requests_and_pngs(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    detailed, plots = tmp_path / "run.json", tmp_path / "plots"
    with fake_openai_server() as (url, _):
        out, err = bench(
            capsys, "--backend", "openai-chat", "--base-url", url, "--num-requests", "4",
            "--input-len", "12", "--output-len", "5", "--rate", "50", "--json",
            "--save-detailed", str(detailed), "--plot", str(plots), "--no-progress",
        )  # fmt: skip
    assert out["backend"] == "openai-chat" and out["request_rate"] == 50
    assert "input_lens" not in out
    doc = json.loads(detailed.read_text(), parse_constant=refuse)
    assert doc["completed"] == 4 and doc["seed"] == out["seed"]
    assert doc["input_lens"] == [12] * 4 and doc["output_lens"] == [5] * 4
    assert all(len(i) == 4 for i in doc["itls"]) and all(t > 0 for t in doc["ttfts"])
    assert doc["timings"] == [None] * 4 and doc["errors"] == [""] * 4
    assert "replicas_over_time" not in doc  # only pdserve's gRPC API says
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["itl_cdf.png", "latency_over_time.png", "ttft_cdf.png"]
    assert "wrote" in err and "bench [" not in err


def test_markdown_report_names_the_backend_and_target(capsys):
    with fake_openai_server() as (url, _):
        assert main(["bench", "--backend", "openai", "--base-url", url, "--num-requests", "2",
                     "--output-len", "3", "--no-progress"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert text.startswith("# pdserve bench") and f"target: {url} (openai)" in text
    assert "2 of 2 completed" in text and "| time to first token |" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "openai"], "--backend openai needs --base-url"),
        (["--base-url", "http://x/v1"], "--base-url is for the openai backends"),
        (["--goodput", "ttft=5"], "the key must be ttft, tpot or e2el"),
    ],
)
def test_bad_options_are_refused_before_any_request(args, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "--target", "127.0.0.1:1", *args])


def test_plot_without_matplotlib_fails_with_one_line_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_cli, "missing_extra", lambda: "--plot needs matplotlib: x")
    with pytest.raises(SystemExit, match="^--plot needs matplotlib: x$"):
        main(["bench", "--target", "127.0.0.1:1", "--plot", str(tmp_path)])


def test_the_mooncake_trace_ships_with_pdserve():
    path = TRACES["mooncake"]
    assert path.stat().st_size < 1_000_000
    assert (path.parent / "NOTICE.md").read_text().count("Apache") >= 1
    entries = load_trace("mooncake")
    assert len(entries) == 3993 and entries[0].input_length == 40160
    assert load_trace("mooncake", 60, 3800)[0].timestamp_ms == 975398.0


def test_vllm_bench_serve_flag_names_work_and_write_its_result_file(capsys, tmp_path):
    """`pdserve bench --num-prompts 8 --request-rate 2 --dataset-name random` as vLLM's."""
    with fake_openai_server() as (url, _):
        assert main(["bench", "--backend", "openai", "--base-url", url, "--num-prompts", "8",
                     "--request-rate", "2", "--dataset-name", "random", "--random-input-len",
                     "16", "--random-output-len", "3", "--percentile-metrics", "ttft,e2el",
                     "--metric-percentiles", "25,99.9", "--result-dir", str(tmp_path),
                     "--result-filename", "r.json", "--no-progress"]) == 0  # fmt: skip
    doc = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert (doc["completed"], doc["num_prompts"], doc["total_input_tokens"]) == (8, 8, 128)
    assert {"p25_ttft_ms", "p99.9_ttft_ms", "median_ttft_ms", "p99.9_e2el_ms"} <= set(doc)
    assert not any(k.endswith(("_itl_ms", "_tpot_ms")) for k in doc)  # not asked for
    assert "| p25 | p99.9 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--metric-percentiles", "50,x"], "--metric-percentiles"),
        (["--metric-percentiles", "0"], "(0, 100]"),
        (["--percentile-metrics", "ttft,foo"], "unknown ['foo']"),
    ],
)
def test_bad_percentile_options_are_refused(args, message):
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("(", r"\(")):
        main(["bench", "--target", "127.0.0.1:1", *args])
