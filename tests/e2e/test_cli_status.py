"""`pdserve status` against the session's "pd" app: one strict JSON object whose pools and
replicas are the app's (2 prefill and 2 decode replicas, nothing in use once idle, each on the
device and dtype its config states; its router replica with its direct gRPC endpoint). And an app
of device and dtype "auto", whose replica decides them where it runs (on this machine: cuda +
bfloat16 if it has a GPU, which Ray then grants the pool, else cpu + float32), as the table and
the JSON show."""

from __future__ import annotations

import json

import pytest

from cluster.cli.main import main
from tests.e2e.conftest import PD
from tests.ray_fixtures import deploy, small_app_config, wait_for_idle

AUTO = "auto-device"


def refuse(constant: str):
    raise ValueError(f"not strict JSON: {constant}")


def test_status_json_describes_the_running_app(apps, capsys):
    wait_for_idle(apps, PD, {"prefill", "decode"})
    capsys.readouterr()
    assert main(["status", "--json", "--target", apps.grpc_target, "--application", PD]) == 0
    out = capsys.readouterr().out

    got = json.loads(out, parse_constant=refuse)
    assert got["model"]["mode"] == "disaggregated" and got["model"]["block_size"] == 16
    assert got["kv_transport"] in ("grpc", "nixl")
    pools = {p["pool"]: p for p in got["pools"]}
    assert pools["prefill"]["current_replicas"] == 2 and pools["decode"]["current_replicas"] == 2
    engines = [r for r in got["replicas"] if r["pool"] in ("prefill", "decode")]
    assert sorted(r["pool"] for r in engines) == ["decode", "decode", "prefill", "prefill"]
    assert all(r["kv_blocks_total"] == 512 and r["kv_blocks_leased"] == 0 for r in engines)
    assert all((r["device"], r["dtype"]) == ("cpu", "float32") for r in engines)
    (router,) = [r for r in got["replicas"] if r["pool"] == "router"]
    host, port = router["grpc_endpoint"].rsplit(":", 1)  # its direct gRPC endpoint
    assert host == "127.0.0.1" and int(port) > 0
    assert (router["device"], router["dtype"]) == ("", "")  # no engine


@pytest.fixture
def auto_app(apps, tokenizer_model_dir):
    from ray import serve

    from cluster.config import ModelConfig

    model = ModelConfig(str(tokenizer_model_dir), device="auto", dtype="auto")
    deploy(small_app_config(str(tokenizer_model_dir), mode="colocated", model=model), AUTO, "/a")
    yield apps
    serve.delete(AUTO)


def test_status_shows_the_device_and_dtype_each_replica_decided(auto_app, capsys):
    import torch

    want = ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")
    (replica,) = wait_for_idle(auto_app, AUTO, {"colocated"})
    assert (replica.device, replica.dtype) == want
    capsys.readouterr()
    assert main(["status", "--target", auto_app.grpc_target, "--application", AUTO]) == 0
    table = capsys.readouterr().out.splitlines()
    header = next(line for line in table if line.startswith("pool ") and "kv total" in line)
    row = table[table.index(header) + 1].split()
    assert header.split()[2:4] == ["device", "dtype"] and (row[0], *row[2:4]) == (
        "colocated", *want
    )  # fmt: skip
    assert main(["status", "--json", "--target", auto_app.grpc_target, "--application", AUTO]) == 0
    got = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert got["model"]["dtype"] == "auto"  # as configured; each replica's is in its stats
    (engine,) = [r for r in got["replicas"] if r["pool"] == "colocated"]
    assert (engine["device"], engine["dtype"]) == want
