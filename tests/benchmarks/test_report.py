"""What every benchmark report starts with, and where it goes by default."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import engine_bench
from benchmarks.report import RESULTS, header, publish


def test_the_header_names_date_commit_machine_and_command() -> None:
    lines = header("A benchmark", "some_bench", ["--quick"])
    assert lines[0] == "# A benchmark"
    assert re.match(r"- date: \d{4}-\d\d-\d\dT", lines[2])
    assert re.match(r"- commit: ([0-9a-f]{7,}|unknown)", lines[3]), lines[3]
    assert lines[4].startswith("- machine: ") and "CPUs" in lines[4]
    assert lines[5] == "- command: `python -m benchmarks.some_bench --quick`"


def test_a_report_is_written_to_out_unless_it_is_a_dash(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sub" / "r.md"
    assert publish("# r\n", out) == "# r\n" and out.read_text("utf-8") == "# r\n"
    publish("# s\n", "-")
    assert "# s" in capsys.readouterr().out


def test_a_run_overwrites_the_benchmarks_one_current_report_by_default() -> None:
    args, _ = engine_bench.parse_args(["--quick"])
    assert Path(args.out) == RESULTS / "engine.md"
