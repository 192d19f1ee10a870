"""The capacity benchmark's "before": the same measurement of the code at another git revision,
in the same run: N = 1 through Serve's proxy (inter-token latency at low load) and N = 64
straight to the router (the CPU per token where the serving path is busy).

The revision's tree is exported (`git archive`, which changes nothing in the checkout) to a
temporary directory, this benchmark's own modules are copied in, and it runs there in a child
process with that directory first on the path of every process it starts (Ray's included), so
its replicas and proxy run the revision's code. The child starts and stops its own Ray before
this process starts its own.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from benchmarks.capacity_report import Point
from benchmarks.report import REPO, log

OWN_MODULES = (
    "capacity_bench.py",
    "capacity_report.py",
    "capacity_before.py",
    "paced_engine.py",
    "stream_load.py",
)


def summary(points: list[Point]) -> list[dict]:
    """What `--json` writes: the figures the comparison needs, per N and path."""
    return [
        {
            "streams": p.streams,
            "path": p.path,
            "interval": p.interval,
            "itl_p50": p.load.itl(0.5),
            "itl_p99": p.load.itl(0.99),
            "ttft_p50": p.load.ttft(0.5),
            "tok_s": p.load.tok_per_s,
            "ratio": p.ratio,
            "path_us": p.path_us,
        }
        for p in points
    ]


def write_json(points: list[Point], path: str) -> None:
    Path(path).write_text(json.dumps(summary(points)), "utf-8")


BEFORE_POINTS = ((1, "proxy"), (64, "direct"))  # (N, path) measured on the revision


def measure_before(rev: str, a: argparse.Namespace) -> list[dict]:
    """`summary` of `BEFORE_POINTS`, measured on the code at `rev`."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    archive = subprocess.run(
        ["git", "archive", rev], cwd=REPO, env=env, capture_output=True, check=True, timeout=120
    ).stdout
    with tempfile.TemporaryDirectory(prefix="pdserve-before-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        for name in OWN_MODULES:
            shutil.copy(REPO / "benchmarks" / name, Path(tmp) / "benchmarks" / name)
        out = Path(tmp) / "before.json"
        argv = ["--tokens", str(a.tokens)]
        argv += ["--prompt-tokens", str(a.prompt_tokens), "--threads", str(a.threads)]
        argv += ["--preset", a.preset, "--repeats", str(a.repeats)]
        argv += ["--out", "-", "--json", str(out)]
        if a.decode_engine_cpus:
            argv += ["--decode-engine-cpus", ",".join(map(str, a.decode_engine_cpus))]
        if a.model_dir:
            argv += ["--model-dir", str(a.model_dir)]
        path = os.pathsep.join([tmp, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        child = {**env, "PYTHONPATH": path, "PDSERVE_COMMIT": rev}
        got = []
        for streams, route in BEFORE_POINTS:
            log(f"before: {rev}'s code, N = {streams} by {route}, in {tmp}")
            subprocess.run(
                [sys.executable, "-m", "benchmarks.capacity_bench", *argv]
                + ["--streams", str(streams), "--paths", route],
                cwd=tmp,
                env=child,
                check=True,
                stdout=subprocess.DEVNULL,
                timeout=1800,
            )
            got += json.loads(out.read_text("utf-8"))
        return got
