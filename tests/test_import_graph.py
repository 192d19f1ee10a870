"""The folder contract of ARCHITECTURE.md section 3, checked on the source, statically,
including imports inside functions:

- each plane of `cluster` imports only the planes its `__init__.py` allows;
- each role package imports only itself and `cluster`; roles never import each other;
- no import cycle anywhere in the hand-written source, module by module;
- `router.direct`, the router's own gRPC server, imports nothing else of the project;
- `cluster.client` and `cluster.planner` never import torch, even indirectly (checked by
  importing them);
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
ROOT_MODULES = {
    "cluster.config",
    "cluster.errors",
    "cluster.request",
    "cluster.sampling_params",
    "cluster.structured_output",
}
PLANES = ("model", "engine", "kv_transfer", "serving", "client", "planner", "cli", "pb")

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
    "cluster.planner": {"cluster", "cluster.client", "cluster.planner"},
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


# -- no import cycles, and the direct endpoint on its own ------------------------------------

HAND_WRITTEN = ("cluster", "prefill_worker", "decode_worker", "router")
GENERATED = ("cluster.pb",)


def module_files(root: Path, tops: tuple[str, ...], skip: tuple[str, ...] = ()) -> dict:
    """Every module under the folders `tops` of `root` by dotted name (a package by its own
    name, for its `__init__.py`), but those in or under a name of `skip`."""
    files = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            if not any(name == s or name.startswith(s + ".") for s in skip):
                files[name] = path
    return files


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module to the modules of `files` it imports, anywhere in its body (functions and
    `TYPE_CHECKING` blocks included). An import names the deepest module it reaches: `from
    a.b import c` is a.b.c where that is a module, else a.b (its `__init__`)."""

    def reached(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges |= {reached(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in node.names:
                    full = f"{base}.{a.name}"
                    edges.add(full if full in files else reached(base))
        graph[name] = edges - {None, name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycle_in_the_hand_written_source():
    files = module_files(ROOT, HAND_WRITTEN, skip=GENERATED)
    assert "cluster.engine.engine" in files and "router.direct" in files
    assert not any(n.startswith("cluster.pb") for n in files)
    cycles = import_cycles(import_graph(files))
    assert not cycles, f"modules that import each other, directly or around a circle: {cycles}"


def test_checker_sees_a_cycle(tmp_path):
    """A cycle through an import inside a function, one through a package's `__init__`, a
    relative one, and a module that only imports without closing a cycle."""
    for path, text in {
        "p/__init__.py": "",
        "p/a.py": "def f():\n    import p.b\n",
        "p/b.py": "from p import a\n",
        "p/c.py": "import p.a\nimport json\n",
        "q/__init__.py": "from q.x import X\nHELPER = 1\n",
        "q/x.py": "from q import HELPER\nX = HELPER\n",
        "r/__init__.py": "",
        "r/s/__init__.py": "",
        "r/s/m.py": "from .. import t\n",
        "r/t.py": "from r.s import m\n",
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    graph = import_graph(module_files(tmp_path, ("p", "q", "r")))
    assert graph["p.c"] == {"p.a"} and graph["r.s.m"] == {"r.t"}
    assert import_cycles(graph) == [["p.a", "p.b"], ["q", "q.x"], ["r.s.m", "r.t"]]
    assert import_cycles({**graph, "p.b": set()}) == [["q", "q.x"], ["r.s.m", "r.t"]]


def test_the_direct_endpoint_imports_nothing_else_of_the_project():
    """`router.direct` (the router's own gRPC server) stands alone: nothing of `router` outside
    it, nor of `cluster`; the router hands it what it serves."""
    files = sorted((ROOT / "router" / "direct").glob("*.py"))
    assert len(files) > 1
    outside = {
        str(f.relative_to(ROOT)): sorted(
            m
            for m in imported_modules(f)
            if unit_of_module(m) is not None and not m.startswith("router.direct.")
        )
        for f in files
    }
    assert not any(outside.values()), f"router.direct imports from outside: {outside}"


@pytest.mark.parametrize("plane", ["client", "planner"])
def test_client_and_planner_planes_do_not_import_torch(plane):
    modules = [
        f"cluster.{plane}.{p.stem}"
        for p in sorted((ROOT / "cluster" / plane).glob("*.py"))
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
    assert out.stdout.strip() == "False", f"cluster.{plane} imported torch"


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
