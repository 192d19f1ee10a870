"""The folder contract of ARCHITECTURE.md section 3, checked on the source, statically,
including imports inside functions:

- each plane of `cluster` imports only the planes its `__init__.py` allows;
- each role package imports only itself and `cluster`; roles never import each other;
- `cluster.client` never imports torch, even indirectly (checked by importing it);
- a KV transport's modules are imported only inside its own folder.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"cluster", "prefill_worker", "decode_worker", "router", "benchmarks", "tests"}
ROOT_MODULES = {"cluster.config", "cluster.errors", "cluster.request", "cluster.sampling_params"}
PLANES = ("model", "engine", "kv_transfer", "serving", "client", "cli", "pb")

# What each unit may import. A unit is a plane (`cluster.engine`), the `cluster` root modules
# (`cluster`) or a role package; "cluster" in an allowed set means the root modules.
ALLOWED = {
    "cluster": {"cluster"},
    "cluster.model": {"cluster", "cluster.model"},
    "cluster.engine": {"cluster", "cluster.model", "cluster.engine"},
    "cluster.kv_transfer": {"cluster", "cluster.engine", "cluster.kv_transfer", "cluster.pb"},
    "cluster.serving": {
        "cluster",
        "cluster.model",
        "cluster.engine",
        "cluster.kv_transfer",
        "cluster.serving",
        "cluster.pb",
    },
    "cluster.client": {"cluster", "cluster.client", "cluster.pb"},
    "cluster.cli": {"cluster", *(f"cluster.{p}" for p in PLANES)},
    "cluster.pb": {"cluster.pb"},
    "prefill_worker": {"prefill_worker", "cluster", *(f"cluster.{p}" for p in PLANES)},
    "decode_worker": {"decode_worker", "cluster", *(f"cluster.{p}" for p in PLANES)},
    "router": {"router", "cluster", *(f"cluster.{p}" for p in PLANES)},
}


def unit_of_module(name: str) -> str | None:
    """The unit a dotted module name belongs to, or None for a third-party module."""
    parts = name.split(".")
    if parts[0] not in FIRST_PARTY:
        return None
    if parts[0] != "cluster":
        return parts[0]
    if len(parts) > 1 and parts[1] in PLANES:
        return f"cluster.{parts[1]}"
    return "cluster"


def unit_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return unit_of_module(".".join(rel.parts)) or ""


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from cluster import errors` imports cluster.errors, not the package alone
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def forbidden(path: Path, unit: str) -> set[str]:
    units = {unit_of_module(m) for m in imported_modules(path)} - {None}
    return units - ALLOWED[unit]


def sources(unit: str) -> list[Path]:
    if unit == "cluster":
        return sorted(ROOT / "cluster" / (m.split(".")[1] + ".py") for m in ROOT_MODULES)
    folder = ROOT.joinpath(*unit.split("."))
    return sorted(p for p in folder.rglob("*.py") if "pdserve" not in p.parts)


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_unit_imports_only_what_it_may(unit):
    files = sources(unit)
    assert files, f"{unit} has no sources"
    bad = {str(f.relative_to(ROOT)): sorted(forbidden(f, unit)) for f in files}
    bad = {f: units for f, units in bad.items() if units}
    assert not bad, f"forbidden imports: {bad}"


def test_every_cluster_module_belongs_to_a_unit():
    loose = {
        p.name
        for p in (ROOT / "cluster").glob("*.py")
        if p.name != "__init__.py" and f"cluster.{p.stem}" not in ROOT_MODULES
    }
    assert not loose, f"modules outside the root vocabulary and every plane: {sorted(loose)}"


def test_checker_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text(
        "import torch\n"
        "def f():\n"
        "    from cluster.serving.app import build_app\n"
        "    from router.router import Router\n"
    )
    assert forbidden(bad, "cluster.engine") == {"cluster.serving", "router"}
    assert forbidden(bad, "cluster.cli") == {"router"}


def test_client_plane_does_not_import_torch():
    modules = [
        f"cluster.client.{p.stem}"
        for p in sorted((ROOT / "cluster" / "client").glob("*.py"))
        if p.stem != "__init__"
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", "cluster.client imported torch"


def test_proto_folder_is_not_a_python_package():
    assert not list((ROOT / "proto").rglob("*.py"))


TRANSPORT_FOLDERS = sorted(
    p.parent.name
    for p in (ROOT / "cluster" / "kv_transfer").glob("*/__init__.py")
    if p.parent.name != "pdserve"
)
PRODUCT = ("cluster", "prefill_worker", "decode_worker", "router")


def test_a_transports_modules_are_imported_only_inside_its_folder():
    """A KV transport is one folder: outside `cluster/kv_transfer/<name>/` the product's source
    never imports it (the registry names its package by its dotted path and imports nothing of
    it), so adding or removing a transport touches its folder and one registry line."""
    assert {"grpc", "nixl", "collective"} <= set(TRANSPORT_FOLDERS)
    bad = {}
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            for name in TRANSPORT_FOLDERS:
                pkg = f"cluster.kv_transfer.{name}"
                if rel.parts[:3] == ("cluster", "kv_transfer", name):
                    continue
                hits = {m for m in imported_modules(path) if m == pkg or m.startswith(pkg + ".")}
                if hits:
                    bad[str(rel)] = sorted(hits)
    assert not bad, f"transport modules imported outside their folder: {bad}"
