"""Generates the committed Python modules for the `.proto` wire contracts.

`proto/` holds `.proto` sources only: the import name `proto` belongs to proto-plus (installed
by ray[serve]), so the generated modules live in the package `cluster.pb`, which mirrors the
proto package path (`pdserve/v1/generation.proto` -> `cluster.pb.pdserve.v1.generation_pb2`).
protoc writes imports as `from pdserve.v1 import x_pb2`; they are rewritten to
`cluster.pb.pdserve.v1` so the modules import on every node without touching `sys.path`.

Run `python -m cluster.pb.generate` after editing any `.proto` file and commit the result;
`tests/cluster/pb/test_protos.py` fails when the committed modules drift from the sources.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"
DEFAULT_OUT_ROOT = Path(__file__).resolve().parent
PACKAGE = "cluster.pb"

_GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_INIT_DOC = (
    '"""Generated protobuf and gRPC modules. Do not edit; run `python -m cluster.pb.generate`."""\n'
)


def generate(out_root: Path) -> list[Path]:
    """Compiles every `.proto` under `proto/` into `out_root` and returns the files written.

    `out_root` plays the role of the `cluster.pb` package: modules land in
    `out_root/pdserve/v1/`, with `__init__.py` files down the tree. Generated files in
    `out_root` that no longer have a source are removed.
    """
    # grpcio-tools is a dev dependency: import it only when generating.
    import grpc_tools

    sources = sorted(PROTO_ROOT.rglob("*.proto"))
    if not sources:
        raise FileNotFoundError(f"no .proto files under {PROTO_ROOT}")
    well_known_types = Path(grpc_tools.__file__).resolve().parent / "_proto"

    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp)
        args = [
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--proto_path={well_known_types}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *(str(source) for source in sources),
        ]
        # In a child process: protoc crashes in a process that has loaded NIXL, whose bundled
        # abseil clashes with the one grpcio-tools links (a test session loads both).
        if subprocess.run([sys.executable, "-m", *args], check=False).returncode != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")

        proto_packages = sorted({p.parent.relative_to(raw) for p in _generated_files(raw)})
        written = _write_init_files(out_root, proto_packages)
        _remove_stale(out_root, {p.relative_to(raw) for p in _generated_files(raw)})
        for generated in sorted(_generated_files(raw)):
            target = out_root / generated.relative_to(raw)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(
                _rewrite_imports(generated.read_text(), proto_packages), encoding="utf-8"
            )
            written.append(target)
    return written


def _generated_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name.endswith(_GENERATED_SUFFIXES)]


def _write_init_files(out_root: Path, proto_packages: list[Path]) -> list[Path]:
    """Writes `__init__.py` in `out_root` and every directory down to each proto package."""
    dirs = {out_root}
    for package in proto_packages:
        for depth in range(1, len(package.parts) + 1):
            dirs.add(out_root.joinpath(*package.parts[:depth]))
    written = []
    for directory in sorted(dirs):
        directory.mkdir(parents=True, exist_ok=True)
        init = directory / "__init__.py"
        init.write_text(_INIT_DOC, encoding="utf-8")
        written.append(init)
    return written


def _remove_stale(out_root: Path, keep: set[Path]) -> None:
    if not out_root.exists():
        return
    for existing in _generated_files(out_root):
        if existing.relative_to(out_root) not in keep:
            existing.unlink()


def _rewrite_imports(text: str, proto_packages: list[Path]) -> str:
    """Moves protoc's module references (`pdserve.v1.x_pb2`) under `cluster.pb`."""
    for package in proto_packages:
        if not package.parts:  # a .proto without a package: nothing to move
            continue
        dotted = ".".join(package.parts)
        escaped = re.escape(dotted)
        target = f"{PACKAGE}.{dotted}"
        # from pdserve.v1 import x_pb2 as alias
        text = re.sub(
            rf"^(\s*)from {escaped} import ", rf"\1from {target} import ", text, flags=re.M
        )
        # import pdserve.v1.x_pb2 as alias
        text = re.sub(
            rf"^(\s*)import {escaped}\.(\w+) as ",
            rf"\1from {target} import \2 as ",
            text,
            flags=re.M,
        )
        # Module name given to the descriptor builder; becomes each message's __module__,
        # which pickling (e.g. by Ray) uses to find the class again.
        text = re.sub(rf"'{escaped}\.(\w+_pb2)'", rf"'{target}.\1'", text)
    return text


def main() -> None:
    for path in generate(DEFAULT_OUT_ROOT):
        print(path.relative_to(PROTO_ROOT.parent))


if __name__ == "__main__":
    main()
