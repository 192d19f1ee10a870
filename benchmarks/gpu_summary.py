"""The GPU check's one acceptance table: issue 20's figures, each beside its target.

    python -m benchmarks.gpu_summary OUT_DIR

Reads what `benchmarks/gpu_check.sh` leaves in OUT_DIR: the GPU tests' JUnit XML (`tests.xml`)
and the engine benchmark's `--json` figures of its three engine stages. A figure whose file is
missing or unreadable, whose run had another setup (preset, dtype, device, graphs) or lacks the
batch is "not measured", never PASS: a stage that failed or timed out shows as such.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

TESTS = "tests.xml"
SMALL = "engine.json"  # `small` bf16, CUDA-graph decode, batches 1 and 128
EAGER = "engine-eager.json"  # the same with --no-cuda-graphs
ONE_B = "engine-1b.json"  # `1b` bf16, batch 1

# Issue 20's targets.
STEP_MS = 1.5  # `small` bf16 batch-1 decode step, ms
DECODE_TOK_S = 30_000  # `small` bf16 batch-128 decode
PREFILL_VS_HF = 1.0  # `small` bf16 prefill of 128 x 128 tokens over HF generate's
FLOOR_RATIO = 2.0  # `1b` bf16 batch-1 decode step over its weight-read floor
GRAPHS_VS_EAGER = 1.0  # decode step with graphs over the eager one: never slower


class NotMeasured(Exception):
    """A figure that its stage's files do not give; the message says why."""


@dataclass(frozen=True)
class Row:
    figure: str
    target: str
    measured: str
    passed: bool | None  # None: not measured

    @property
    def result(self) -> str:
        return {True: "PASS", False: "FAIL", None: "not measured"}[self.passed]


Check = Callable[[], tuple[str, bool]]


def rows(folder: Path) -> list[Row]:
    """Every figure of the table, read from `folder`."""
    graphs = f"<= {GRAPHS_VS_EAGER:g}x"
    checks: list[tuple[str, str, Callable[[Path], tuple[str, bool]]]] = [
        ("GPU tests (`gpu` marker)", "all pass", _tests),
        ("`small` bf16 decode step, batch 1", f"<= {STEP_MS} ms", _step),
        ("`small` bf16 decode, batch 128", f">= {DECODE_TOK_S:,} tok/s", _decode),
        ("`small` bf16 prefill 128 x 128 / HF generate", f">= {PREFILL_VS_HF:g}x", _prefill),
        ("`1b` bf16 decode step, batch 1 / weight-read floor", f"<= {FLOOR_RATIO:g}x", _floor),
        ("`small` bf16 decode step, batch 1, graphs / eager", graphs, partial(_graphs, batch=1)),
        (
            "`small` bf16 decode step, batch 128, graphs / eager",
            graphs,
            partial(_graphs, batch=128),
        ),
    ]
    return [_row(figure, target, partial(check, folder)) for figure, target, check in checks]


def render(table: list[Row]) -> str:
    lines = ["| figure | target | measured | result |", "|---|---|---|---|"]
    lines += [f"| {r.figure} | {r.target} | {r.measured} | {r.result} |" for r in table]
    return "\n".join(lines) + "\n"


def _row(figure: str, target: str, check: Check) -> Row:
    try:
        measured, passed = check()
    except NotMeasured as e:
        return Row(figure, target, f"not measured ({e})", None)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        return Row(figure, target, f"not measured (malformed figures: {e!r})", None)
    return Row(figure, target, measured, passed)


def _tests(folder: Path) -> tuple[str, bool]:
    try:
        root = ET.parse(folder / TESTS).getroot()
    except (OSError, ET.ParseError) as e:
        raise NotMeasured(_unreadable(TESTS, e)) from e
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    if not suites:
        raise NotMeasured(f"{TESTS} has no test suite")
    tests, failed, skipped = (
        sum(int(s.get(k, 0)) for s in suites for k in keys)
        for keys in (("tests",), ("failures", "errors"), ("skipped",))
    )
    passed = tests - failed - skipped
    return f"{passed} passed, {failed} failed, {skipped} skipped", failed == 0 and passed > 0


def _step(folder: Path) -> tuple[str, bool]:
    ms = _measurement(_engine(folder, SMALL, "small"), 1)["decode_step_s"] * 1e3
    return f"{ms:.2f} ms", ms <= STEP_MS


def _decode(folder: Path) -> tuple[str, bool]:
    tok_s = _measurement(_engine(folder, SMALL, "small"), 128)["decode_tok_s"]
    return f"{tok_s:,.0f} tok/s", tok_s >= DECODE_TOK_S


def _prefill(folder: Path) -> tuple[str, bool]:
    run = _engine(folder, SMALL, "small")
    if run["prompt_len"] != 128:
        raise NotMeasured(f"{SMALL}: prompts of {run['prompt_len']} tokens, not 128")
    pd = _measurement(run, 128)["prefill_tok_s"]
    hf = _measurement(run, 128, "hf generate")["prefill_tok_s"]
    return f"{pd:,.0f} / {hf:,.0f} tok/s = {pd / hf:.2f}x", pd / hf >= PREFILL_VS_HF


def _floor(folder: Path) -> tuple[str, bool]:
    run = _engine(folder, ONE_B, "1b")
    step, floor = _measurement(run, 1)["decode_step_s"], run["floor_step_s"]
    return (
        f"{step * 1e3:.2f} / {floor * 1e3:.2f} ms = {step / floor:.2f}x",
        step / floor <= FLOOR_RATIO,
    )


def _graphs(folder: Path, batch: int) -> tuple[str, bool]:
    graphs = _measurement(_engine(folder, SMALL, "small"), batch)["decode_step_s"]
    eager = _measurement(_engine(folder, EAGER, "small", graphs=False), batch)["decode_step_s"]
    return (
        f"{graphs * 1e3:.2f} / {eager * 1e3:.2f} ms = {graphs / eager:.2f}x",
        graphs / eager <= GRAPHS_VS_EAGER,
    )


def _engine(folder: Path, name: str, preset: str, graphs: bool = True) -> dict:
    """The figures in `name`, checked to be of `preset` in bf16 on a GPU, graphs on or off."""
    try:
        run = json.loads((folder / name).read_text("utf-8"))
    except (OSError, ValueError) as e:
        raise NotMeasured(_unreadable(name, e)) from e
    want = {"preset": preset, "dtype": "bfloat16", "cuda_graphs": graphs}
    got = {k: run.get(k) for k in want}
    if got != want or not str(run.get("device", "")).startswith("cuda"):
        raise NotMeasured(f"{name} is of another run: {got}, device {run.get('device')}")
    return run


def _unreadable(name: str, e: Exception) -> str:
    return f"no {name}" if isinstance(e, FileNotFoundError) else f"{name} unreadable: {e}"


def _measurement(run: dict, batch: int, system: str = "pdserve") -> dict:
    for m in run["results"]:
        if m["system"] == system and m["batch"] == batch:
            return m
    raise NotMeasured(f"{system} batch {batch} not run")


def main(argv: list[str] | None = None) -> str:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit(__doc__)
    table = render(rows(Path(args[0])))
    print(table, end="")
    return table


if __name__ == "__main__":
    main()
