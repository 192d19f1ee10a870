"""The size rules of issue 18, on every Python source in the repository: no module over 400
lines outside the generated `cluster/pb` stubs, and no function over 80 lines outside the
model's forward code (none is that long today; an exemption would be listed here by name)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "router", "prefill_worker", "decode_worker", "benchmarks", "tests")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
FORWARD_EXEMPT: set[str] = set()  # "cluster/model/x.py:Class.forward", should one need it


def python_sources() -> list[Path]:
    files = []
    for package in PACKAGES:
        files += [
            p
            for p in (ROOT / package).rglob("*.py")
            if not p.relative_to(ROOT).as_posix().startswith("cluster/pb/pdserve/")
        ]
    return sorted(files)


def long_functions(path: Path, limit: int) -> list[str]:
    """`path:qualified.name (N lines)` for every function or method longer than `limit`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT).as_posix()
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = getattr(child, "name", None)
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = child.end_lineno - child.lineno + 1
                key = f"{rel}:{prefix}{name}"
                if lines > limit and key not in FORWARD_EXEMPT:
                    found.append(f"{key} ({lines} lines)")
                visit(child, f"{prefix}{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_sources_are_found():
    files = python_sources()
    assert any(p.name == "engine.py" for p in files)
    assert not any("pdserve" in p.relative_to(ROOT).parts for p in files)


def test_no_module_over_400_lines():
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in python_sources()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_80_lines():
    long = [f for p in python_sources() for f in long_functions(p, MAX_FUNCTION_LINES)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_function_check_sees_a_long_method(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    src = tmp_path / "m.py"
    body = "\n".join(f"        x{i} = {i}" for i in range(5))
    src.write_text(f"class A:\n    def f(self):\n{body}\n        return 0\n")
    assert long_functions(src, 5) == ["m.py:A.f (7 lines)"]
    assert long_functions(src, 7) == []
