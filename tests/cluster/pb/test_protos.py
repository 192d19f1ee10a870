"""The committed generated modules match the .proto sources and import as `cluster.pb`."""

from __future__ import annotations

import importlib
import pickle
import re
from pathlib import Path

import pytest

import cluster.pb.generate as protos

COMMITTED_ROOT = protos.DEFAULT_OUT_ROOT

# Lines that only record which protoc / grpcio-tools release wrote the file.
_VERSION_LINES = re.compile(
    r"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*)$\n?", flags=re.M
)
_RUNTIME_CHECK_ARGS = re.compile(
    r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)"
    r"\s*\d+,\s*\d+,\s*\d+,\s*'[^']*',"
)


def _without_versions(text: str) -> str:
    return _RUNTIME_CHECK_ARGS.sub(r"\1 <version>,", _VERSION_LINES.sub("", text))


def _tree(root: Path) -> dict[str, str]:
    """The generated files under `root` (the generator itself lives beside them)."""
    return {
        str(p.relative_to(root)): p.read_text(encoding="utf-8")
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix in (".py", ".pyi") and p.name != "generate.py"
    }


def test_committed_modules_match_sources(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    written = protos.generate(tmp_path)
    assert written, "generate() wrote nothing"

    fresh, committed = _tree(tmp_path), _tree(COMMITTED_ROOT)
    hint = "generated modules are stale: run `python -m cluster.pb.generate` and commit cluster/pb"
    assert sorted(fresh) == sorted(committed), hint
    for name in fresh:
        assert _without_versions(fresh[name]) == _without_versions(committed[name]), (
            f"{name}: {hint}"
        )


def test_version_masking_ignores_only_version_lines() -> None:
    text = (COMMITTED_ROOT / "pdserve" / "v1" / "generation_pb2.py").read_text()
    bumped = re.sub(r"# Protobuf Python Version: .*", "# Protobuf Python Version: 99.0.1", text)
    bumped = _RUNTIME_CHECK_ARGS.sub(r"\1 99, 0, 1, '',", bumped)
    assert bumped != text
    assert _without_versions(bumped) == _without_versions(text)
    assert _without_versions(text.replace("GenerateRequest", "GenerateRequesd")) != (
        _without_versions(text)
    )


def test_generation_service_shape() -> None:
    from cluster.pb.pdserve.v1 import generation_pb2

    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "pdserve.v1.Generation"
    shapes = {
        m.name: (
            m.input_type.name,
            m.output_type.name,
            m.client_streaming,
            m.server_streaming,
        )
        for m in service.methods
    }
    assert shapes == {
        "Generate": ("GenerateRequest", "GenerateResponse", False, True),
        "GetModelInfo": ("GetModelInfoRequest", "ModelInfo", False, False),
        "GetStats": ("GetStatsRequest", "ClusterStats", False, False),
    }


def test_kv_transfer_service_shape() -> None:
    from cluster.pb.pdserve.v1 import kv_transfer_pb2

    service = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
    shapes = {
        m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
        for m in service.methods
    }
    assert shapes == {
        "FetchKV": ("FetchKVRequest", "KVChunk", False, True),
        "ReleaseKV": ("ReleaseKVRequest", "ReleaseKVResponse", False, False),
        "CancelPrefill": ("CancelPrefillRequest", "CancelPrefillResponse", False, False),
        "OpenChannel": ("OpenChannelRequest", "OpenChannelResponse", False, False),
        "PushKV": ("PushKVRequest", "PushKVResponse", False, False),
        "CloseChannel": ("CloseChannelRequest", "CloseChannelResponse", False, False),
        "ConnectNixl": ("ConnectNixlRequest", "NixlPool", False, False),
        "HoldKV": ("HoldKVRequest", "KVHeld", False, True),
        "PinKV": ("PinKVRequest", "KVPinned", False, True),
        "ImportKV": ("ImportKVRequest", "ImportKVResponse", False, False),
    }


@pytest.mark.parametrize(
    "module",
    ["generation_pb2", "generation_pb2_grpc", "kv_transfer_pb2", "kv_transfer_pb2_grpc"],
)
def test_modules_import_under_cluster_pb(module: str) -> None:
    imported = importlib.import_module(f"cluster.pb.pdserve.v1.{module}")
    assert imported.__name__ == f"cluster.pb.pdserve.v1.{module}"


def test_servicer_adder_and_messages_are_importable_by_name() -> None:
    # Ray Serve's gRPC proxy imports the adder by dotted path on every node, and Ray pickles
    # messages between processes: both must resolve under `cluster.pb`.
    from cluster.pb.pdserve.v1 import generation_pb2, generation_pb2_grpc

    assert callable(generation_pb2_grpc.add_GenerationServicer_to_server)
    request = generation_pb2.GenerateRequest(
        prompt="hi", sampling=generation_pb2.SamplingParams(max_tokens=4, temperature=0.0)
    )
    assert type(request).__module__ == "cluster.pb.pdserve.v1.generation_pb2"
    assert pickle.loads(pickle.dumps(request)) == request


def test_import_proto_is_still_proto_plus() -> None:
    repo_proto_dir = protos.PROTO_ROOT
    assert not (repo_proto_dir / "__init__.py").exists(), "proto/ must not be a Python package"
    import proto

    assert hasattr(proto, "Message"), "`import proto` must resolve to proto-plus"
    assert Path(proto.__file__).resolve().parent != repo_proto_dir.resolve()
