"""Reading the benchmarks' Markdown reports in their smoke tests."""

from __future__ import annotations


def cells(report: str, label: str) -> list[str]:
    """The cells after the first one of the table row whose first cell is `label`."""
    for line in report.splitlines():
        row = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and row[0] == label:
            return row[1:]
    raise AssertionError(f"no row {label!r} in the report:\n{report}")
