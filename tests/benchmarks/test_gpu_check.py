"""The GPU check on a machine like the lent one (no Ray, no pydantic unless the site bundle brings
them), imitated on this CPU by a `sitecustomize` that hides those packages: the `gpu`-marked
tests still collect without Ray, and without pydantic the script stops at its preflight, with
the reason and the fix in its report, instead of failing every stage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HIDE = """
import sys
HIDDEN = {hidden!r}
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
        return None
sys.meta_path.insert(0, _Hide())
"""


def without(tmp_path: Path, *hidden: str) -> dict[str, str]:
    """An environment whose Python cannot import `hidden`."""
    site = tmp_path / "hide"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE.format(hidden=set(hidden)))
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_gpu_tests_collect_on_a_machine_without_ray(tmp_path: Path):
    env = without(tmp_path, "ray")
    gpu_test = "tests/cluster/engine/test_cuda_graphs.py"
    r = run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m"]
        + ["gpu", "-o", "filterwarnings=ignore::DeprecationWarning", gpu_test],
        env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "test_cuda_graphs.py" in r.stdout and " collected" in r.stdout, r.stdout
    assert "ray" not in r.stderr.lower(), r.stderr


def test_without_pydantic_gpu_check_stops_at_its_preflight_and_says_why(tmp_path: Path):
    env = without(tmp_path, "pydantic")
    out = tmp_path / "out"
    env.update(
        OUT=str(out),
        PYTHON=sys.executable,
        PDSERVE_SITE_BUNDLE=str(tmp_path / "no-bundle.tar.xz"),
        GPU_CHECK_STAGES="tests engine",
    )
    r = run(["bash", "benchmarks/gpu_check.sh"], env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "== preflight failed" in r.stdout and "gpu_site_bundle.sh" in r.stdout, r.stdout
    assert "== tests" not in r.stdout and "== engine" not in r.stdout, r.stdout
    assert not (out / "tests.xml").exists() and not (out / "engine.json").exists()
    report = (out / "README.md").read_text()
    assert "No module named 'pydantic'" in report and "preflight failed" in report, report
    assert "| not measured |" in report, report
