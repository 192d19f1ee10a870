"""Smoke test of the sampler benchmark: a row per row count and setting, timings positive, and
this tree's sampler dispatching no host sync where a per-row sampler would (a stand-in "before"
revision, written here, that reads each sampled row's token back with `int()`)."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import sampler_bench
from cluster.engine.sampler import Sampler


class PerRowSampler:
    """Each sampled row's token read back on its own: one host sync a row."""

    def __call__(self, logits, params, seeds, positions, histories=()):
        tokens = Sampler()(logits, params, seeds, positions, histories)
        return [int(logits[r].argmax()) if p.greedy else tokens[r] for r, p in enumerate(params)]


def test_quick_run_reports_every_setting_and_the_syncs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sampler_bench, "revision_sampler", lambda rev: PerRowSampler)
    report = sampler_bench.main(
        ["--before", "REV", "--rows", "1,4", "--vocab", "512", "--repeats", "1"]
        + ["--out", str(tmp_path / "report.md")]
    )
    cell = r"([\d.]+), (\d+)"
    rows = re.findall(rf"^\| (\d+) \| ([^|]+) \| {cell} \| {cell} \| ([\d.]+) \|$", report, re.M)
    assert len(rows) == 2 * len(sampler_bench.SETTINGS), report
    assert [int(r[0]) for r in rows] == [1] * 5 + [4] * 5
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows)
    assert all(int(r[5]) == 0 for r in rows), report  # this tree: the tokens in one copy
    mixed = [r for r in rows if r[1].strip() == "mixed" and r[0] == "4"][0]
    assert int(mixed[3]) == 1  # the stand-in's greedy row (1 of 4 in the mixed cycle)
    assert (tmp_path / "report.md").read_text() == report
