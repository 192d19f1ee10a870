"""The folder contract of ARCHITECTURE.md section 3: `cluster` imports only itself and
third-party packages; each role package imports only itself and `cluster`; roles never import
each other. Checked on the source, statically, including imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"cluster", "prefill_worker", "decode_worker", "router", "tests"}
ALLOWED = {
    "cluster": {"cluster"},
    "prefill_worker": {"prefill_worker", "cluster"},
    "decode_worker": {"decode_worker", "cluster"},
    "router": {"router", "cluster"},
}


def first_party_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & FIRST_PARTY


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_it_may(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package} has no sources"
    bad = {
        str(f.relative_to(ROOT)): sorted(first_party_imports(f) - ALLOWED[package])
        for f in files
        if first_party_imports(f) - ALLOWED[package]
    }
    assert not bad, f"forbidden imports: {bad}"


def test_checker_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from router.router import Router\n")
    assert first_party_imports(bad) - ALLOWED["cluster"] == {"router"}


def test_proto_folder_is_not_a_python_package():
    assert not list((ROOT / "proto").rglob("*.py"))
