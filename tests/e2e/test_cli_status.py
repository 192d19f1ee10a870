"""`pdserve status --json` against the session's "pd" app: one strict JSON object whose pools and
replicas are the app's (2 prefill and 2 decode replicas, nothing in use once idle; its router
replica with its direct gRPC endpoint)."""

from __future__ import annotations

import json

from cluster.cli.main import main
from tests.e2e.conftest import PD
from tests.ray_fixtures import wait_for_idle


def test_status_json_describes_the_running_app(apps, capsys):
    wait_for_idle(apps, PD, {"prefill", "decode"})
    capsys.readouterr()
    assert main(["status", "--json", "--target", apps.grpc_target, "--application", PD]) == 0
    out = capsys.readouterr().out

    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    got = json.loads(out, parse_constant=refuse)
    assert got["model"]["mode"] == "disaggregated" and got["model"]["block_size"] == 16
    assert got["kv_transport"] in ("grpc", "nixl")
    pools = {p["pool"]: p for p in got["pools"]}
    assert pools["prefill"]["current_replicas"] == 2 and pools["decode"]["current_replicas"] == 2
    engines = [r for r in got["replicas"] if r["pool"] in ("prefill", "decode")]
    assert sorted(r["pool"] for r in engines) == ["decode", "decode", "prefill", "prefill"]
    assert all(r["kv_blocks_total"] == 512 and r["kv_blocks_leased"] == 0 for r in engines)
    (router,) = [r for r in got["replicas"] if r["pool"] == "router"]
    host, port = router["grpc_endpoint"].rsplit(":", 1)  # its direct gRPC endpoint
    assert host == "127.0.0.1" and int(port) > 0
