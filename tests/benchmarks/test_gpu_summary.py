"""The GPU check's acceptance table, from JSON and JUnit fixtures: each figure against its
target, and every missing or mismatched file "not measured", never PASS."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu_summary
from benchmarks.gpu_summary import EAGER, ONE_B, SMALL, TESTS


def engine_run(
    preset: str = "small",
    graphs: bool = True,
    step_s: float = 1e-3,
    decode_tok_s: float = 40_000.0,
    prefill_tok_s: float = 700_000.0,
    hf_prefill_tok_s: float = 600_000.0,
    floor_step_s: float = 6e-4,
    device: str = "cuda",
) -> dict:
    """What `engine_bench --json` writes, for batches 1 and 128."""

    def m(system: str, batch: int, prefill: float) -> dict:
        return {
            "system": system,
            "batch": batch,
            "prefill_tok_s": prefill,
            "decode_tok_s": decode_tok_s if batch == 128 else 1 / step_s,
            "decode_step_s": step_s,
            "other_load": 0.0,
        }

    return {
        "preset": preset,
        "device": device,
        "dtype": "bfloat16",
        "cuda_graphs": graphs,
        "prompt_len": 128,
        "decode_len": 64,
        "batch_tokens": 8192,
        "weight_bytes": 1000,
        "copy_bandwidth": 1000 / floor_step_s,
        "floor_step_s": floor_step_s,
        "results": [
            m(s, b, prefill)
            for s, prefill in (("pdserve", prefill_tok_s), ("hf generate", hf_prefill_tok_s))
            for b in (1, 128)
        ],
    }


def junit(tests: int, failures: int = 0, errors: int = 0, skipped: int = 0) -> str:
    return (
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" '
        f'errors="{errors}" failures="{failures}" skipped="{skipped}" tests="{tests}" '
        'time="1.0"></testsuite></testsuites>'
    )


def write(folder: Path, files: dict[str, dict | str]) -> Path:
    for name, body in files.items():
        text = body if isinstance(body, str) else json.dumps(body)
        (folder / name).write_text(text, "utf-8")
    return folder


def results(folder: Path) -> dict[str, gpu_summary.Row]:
    return {r.figure: r for r in gpu_summary.rows(folder)}


def test_a_full_passing_run_passes_every_figure(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            TESTS: junit(40, skipped=1),
            SMALL: engine_run(),
            EAGER: engine_run(graphs=False, step_s=8e-3),
            ONE_B: engine_run("1b", step_s=1e-3, floor_step_s=6e-4),
        },
    )

    rows = results(tmp_path)

    assert [r.result for r in rows.values()] == ["PASS"] * 7
    assert rows["GPU tests (`gpu` marker)"].measured == "39 passed, 0 failed, 1 skipped"
    assert rows["`small` bf16 decode step, batch 1"].measured == "1.00 ms"
    assert rows["`small` bf16 decode, batch 128"].measured == "40,000 tok/s"
    assert rows["`small` bf16 prefill 128 x 128 / HF generate"].measured.endswith("= 1.17x")
    assert rows["`1b` bf16 decode step, batch 1 / weight-read floor"].measured == (
        "1.00 / 0.60 ms = 1.67x"
    )
    assert rows["`small` bf16 decode step, batch 1, graphs / eager"].measured == (
        "1.00 / 8.00 ms = 0.12x"
    )


def test_figures_off_target_fail(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            TESTS: junit(40, failures=1, errors=1),
            SMALL: engine_run(
                step_s=2e-3, decode_tok_s=29_000, prefill_tok_s=500_000, hf_prefill_tok_s=6e5
            ),
            EAGER: engine_run(graphs=False, step_s=1e-3),
            ONE_B: engine_run("1b", step_s=1.3e-3, floor_step_s=6e-4),
        },
    )

    rows = results(tmp_path)

    assert [r.result for r in rows.values()] == ["FAIL"] * 7
    assert rows["GPU tests (`gpu` marker)"].measured == "38 passed, 2 failed, 0 skipped"


def test_missing_files_are_not_measured_never_pass(tmp_path: Path) -> None:
    rows = gpu_summary.rows(tmp_path)

    assert [r.result for r in rows] == ["not measured"] * 7
    assert all(r.passed is None and r.measured.startswith("not measured (") for r in rows)
    table = gpu_summary.render(rows)
    assert "PASS" not in table and "FAIL" not in table
    assert table.count("| not measured |") == 7


def test_a_failed_stage_leaves_only_its_figures_unmeasured(tmp_path: Path) -> None:
    write(tmp_path, {TESTS: junit(5), SMALL: engine_run(), EAGER: "{truncated"})

    by_result = {r.figure: r.result for r in gpu_summary.rows(tmp_path)}

    assert by_result["`small` bf16 decode step, batch 1"] == "PASS"
    assert by_result["`1b` bf16 decode step, batch 1 / weight-read floor"] == "not measured"
    assert by_result["`small` bf16 decode step, batch 128, graphs / eager"] == "not measured"


def test_a_run_of_another_setup_or_without_the_batch_is_not_measured(tmp_path: Path) -> None:
    small = engine_run()
    small["results"] = [m for m in small["results"] if m["batch"] == 1]
    write(
        tmp_path,
        {
            TESTS: junit(3, skipped=3),  # no CUDA: nothing ran
            SMALL: small,
            EAGER: engine_run(graphs=True),  # graphs were on: not the eager run
            ONE_B: engine_run("1b", device="cpu"),
        },
    )

    rows = results(tmp_path)

    assert rows["GPU tests (`gpu` marker)"].result == "FAIL"
    assert rows["`small` bf16 decode step, batch 1"].result == "PASS"
    assert "batch 128 not run" in rows["`small` bf16 decode, batch 128"].measured
    assert rows["`small` bf16 prefill 128 x 128 / HF generate"].result == "not measured"
    assert rows["`1b` bf16 decode step, batch 1 / weight-read floor"].result == "not measured"
    assert rows["`small` bf16 decode step, batch 1, graphs / eager"].result == "not measured"


def test_main_prints_the_table(tmp_path: Path, capsys) -> None:
    table = gpu_summary.main([str(tmp_path)])

    assert capsys.readouterr().out == table
    assert table.startswith("| figure | target | measured | result |\n|---|---|---|---|\n")
    assert len(table.splitlines()) == 2 + 7
