"""The `pdserve` command's surface: every flag of every verb has help that states its default,
`--version`, `config-schema`, `status --json` / `--watch` (against a fake cluster; the real one
is in tests/e2e/test_cli_status.py) and `serve --config` refusing a bad file before Ray
starts."""

from __future__ import annotations

import argparse
import io
import json
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
import yaml

from cluster.cli.main import HelpFormatter, build_parser, main
from cluster.cli.status import Snapshot, render, show_status, status_json
from cluster.pb.pdserve.v1 import generation_pb2 as pb

ROOT = Path(__file__).resolve().parents[3]
PRODUCTION = ROOT / "deploy" / "serve" / "production.yaml"


def verbs() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_verb_is_there():
    assert set(verbs()) == {
        "make-model", "generate", "serve", "status", "bench", "phases", "profile", "plan",
        "config-schema",
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(verbs()))
def test_every_flag_has_help_that_states_its_default(name):
    parser = verbs()[name]
    text = parser.format_help()
    formatter = HelpFormatter(prog="pdserve")
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    for action in actions:
        assert action.help and action.help.strip(), f"{name} {action.dest}: no help"
        assert all(o in text for o in action.option_strings), f"{name}: {action.dest} not listed"
        if action.option_strings:  # positionals that must be given have no default to state
            shown = formatter._get_help_string(action) % {"default": action.default}
            assert "default" in shown, f"{name} {action.option_strings[0]}: {shown!r}"


def test_the_formatter_adds_the_default_only_where_the_help_does_not_say_it():
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--n", type=int, default=3, help="count")
    parser.add_argument("--m", default=None, help="thing (default: none)")
    text = " ".join(parser.format_help().split())
    assert "count (default: 3)" in text and "thing (default: none)" in text
    assert "(default: None)" not in text


def test_version_is_the_packages(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"pdserve {version}"


def test_config_schema_prints_the_json_schema_of_the_app_config(capsys):
    assert main(["config-schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["$schema"].endswith("2020-12/schema")
    assert schema["additionalProperties"] is False
    top = {"model", "mode", "router", "prefill", "decode", "transfer", "default_max_tokens"}
    assert top <= set(schema["properties"])
    assert set(schema["$defs"]) >= {"PoolConfig", "CacheConfig", "AutoscalingSettings"}


def snapshot() -> Snapshot:
    info = pb.ModelInfo(model_id="tiny@0", block_size=16, mode="disaggregated", vocab_size=9)
    signal = pb.LoadSignal(name="queued_prompt_tokens", value=48, target_per_replica=2048)
    stats = pb.ClusterStats(
        kv_transport="grpc",
        pools=[pb.PoolStatus(pool="prefill", deployment="Prefill", current_replicas=2,
                             target_replicas=2, min_replicas=1, max_replicas=4,
                             signals=[signal])],
        replicas=[pb.ReplicaStats(pool="prefill", replica_id="r1", kv_blocks_total=512,
                                  kv_blocks_used=3, queued_prompt_tokens=48,
                                  generated_tokens=2**40)],
    )  # fmt: skip
    return Snapshot(info, stats, datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC))


def strict_json(line: str):
    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def test_status_json_is_strict_json_with_every_field():
    out = io.StringIO()
    assert show_status(snapshot, as_json=True, watch=None, out=out) == 0
    (line,) = out.getvalue().splitlines()
    got = strict_json(line)
    assert got == json.loads(json.dumps(status_json(snapshot())))
    assert got["time"] == "2025-01-02T03:04:05.000+00:00" and got["kv_transport"] == "grpc"
    assert got["model"]["model_id"] == "tiny@0" and got["model"]["max_context_length"] == 0
    (pool,) = got["pools"]
    assert pool["signals"][0] == {
        "name": "queued_prompt_tokens", "value": 48.0, "target_per_replica": 2048.0
    }  # fmt: skip
    (replica,) = got["replicas"]
    assert replica["generated_tokens"] == 2**40  # uint64: a number, not a string
    assert replica["kv_blocks_leased"] == 0  # every field, set or not


class Stop(Exception):
    pass


def test_status_watch_refreshes_until_ctrl_c():
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) % 3 == 0:
            raise KeyboardInterrupt

    out = io.StringIO()
    assert show_status(snapshot, as_json=True, watch=0.5, out=out, sleep=sleep) == 0
    assert [strict_json(line)["kv_transport"] for line in out.getvalue().splitlines()] == [
        "grpc"
    ] * 3
    assert sleeps == [0.5] * 3
    tables = io.StringIO()
    assert show_status(snapshot, as_json=False, watch=1, out=tables, sleep=sleep) == 0
    text = tables.getvalue()
    assert (
        "Ctrl-C to stop" in text and "kv used" in text and "queued_prompt_tokens 48 / 2048" in text
    )


class Unreachable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


def test_status_reports_a_failed_read_and_watching_retries(capsys):
    def fail() -> Snapshot:
        raise Unreachable()

    assert show_status(fail, as_json=True, watch=None, out=io.StringIO()) == 2
    assert "error (UNAVAILABLE): connection refused" in capsys.readouterr().err
    reads = iter([fail, snapshot])
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    out = io.StringIO()
    assert show_status(lambda: next(reads)(), as_json=True, watch=0.1, out=out, sleep=sleep) == 0
    assert len(out.getvalue().splitlines()) == 1  # the second read's
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_status_watch_must_be_positive():
    with pytest.raises(SystemExit, match="--watch must be > 0"):
        main(["status", "--watch", "0"])


def test_serve_refuses_a_bad_config_file_before_ray_starts(tmp_path, capsys, monkeypatch):
    import ray

    started = []  # (the session's Ray may be up already: watch for a start, not the state)
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(a))
    raw = yaml.safe_load(PRODUCTION.read_text())
    raw["applications"][0]["args"]["prefill"]["cache"]["num_blocks"] = "1024"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{bad}: application 'pdserve', args: prefill.cache.num_blocks: expected an integer" in err
    )
    raw = yaml.safe_load(PRODUCTION.read_text())
    raw["applications"][0]["deployments"][1]["ray_actor_options"] = {"num_cpus": 1}
    bad.write_text(yaml.safe_dump(raw))
    assert main(["serve", "--config", str(bad)]) == 2
    assert "deployments[Prefill].ray_actor_options" in capsys.readouterr().err
    assert not started


def test_status_shows_each_routers_direct_endpoint():
    with_routers = snapshot()
    with_routers.stats.replicas.extend(
        [
            pb.ReplicaStats(pool="router", replica_id="rt0", grpc_endpoint="10.0.0.5:41000"),
            pb.ReplicaStats(pool="router", replica_id="rt1"),  # router.direct_grpc off
        ]
    )
    lines = render(with_routers)
    at = lines.index(next(line for line in lines if line.startswith("router ")))
    assert lines[at].split() == ["router", "direct", "grpc", "endpoint"]
    assert lines[at + 1].split() == ["rt0", "10.0.0.5:41000"]
    assert lines[at + 2].split() == ["rt1", "off"]
    engine_rows = [line.split()[0] for line in lines[:at] if line.startswith(("prefill", "router"))]
    assert engine_rows == ["prefill", "prefill"]  # the pool's row and r1's; no router among them
    out = io.StringIO()
    assert show_status(lambda: with_routers, as_json=True, watch=None, out=out) == 0
    routers = [r for r in strict_json(out.getvalue())["replicas"] if r["pool"] == "router"]
    assert [r["grpc_endpoint"] for r in routers] == ["10.0.0.5:41000", ""]


def test_status_shows_each_engine_replicas_device_dtype_and_tp_size():
    shot = snapshot()
    shot.stats.replicas.append(
        pb.ReplicaStats(
            pool="decode", replica_id="d1", device="cuda", dtype="bfloat16", tensor_parallel_size=2
        )
    )
    shot.stats.replicas[0].device, shot.stats.replicas[0].dtype = "cpu", "float32"
    lines = render(shot)
    at = lines.index(next(line for line in lines if line.startswith("pool  ") and "kv" in line))
    assert lines[at].split()[:6] == ["pool", "replica", "device", "dtype", "tp", "kv"]
    # r1 as a server from before the field reports it: 0, shown as "-"
    assert lines[at + 1].split()[:6] == ["prefill", "r1", "cpu", "float32", "-", "512"]
    assert lines[at + 2].split()[:5] == ["decode", "d1", "cuda", "bfloat16", "2"]
    (r1, d1) = strict_json(json.dumps(status_json(shot)))["replicas"]
    assert (r1["device"], r1["dtype"], d1["device"], d1["dtype"]) == (
        "cpu", "float32", "cuda", "bfloat16"
    )  # fmt: skip
    assert d1["tensor_parallel_size"] == 2


def test_status_lists_where_each_tp_rank_runs():
    shot = snapshot()
    node = "ab" * 28
    places = [pb.RankPlace(rank=r, node_id=node, node_ip="10.0.0.7", pid=4100 + r) for r in (0, 1)]
    shot.stats.replicas.append(
        pb.ReplicaStats(pool="decode", replica_id="d1", tensor_parallel_size=2, ranks=places)
    )
    shot.stats.replicas.append(pb.ReplicaStats(pool="router", replica_id="rt0"))
    lines = render(shot)
    at = lines.index(next(line for line in lines if line.startswith("replica ")))
    assert lines[at].split() == ["replica", "rank", "node", "ip", "pid", "node", "id"]
    assert lines[at + 1].split() == ["d1", "0", "10.0.0.7", "4100", node]
    assert lines[at + 2].split() == ["d1", "1", "10.0.0.7", "4101", node]
    assert lines[at + 3] == ""  # then the routers' table; r1 (no ranks reported) has no row
    (_, d1, _) = strict_json(json.dumps(status_json(shot)))["replicas"]
    assert d1["ranks"][1] == {"rank": 1, "node_id": node, "node_ip": "10.0.0.7", "pid": 4101}


def test_status_lists_no_rank_table_when_no_replica_reports_ranks():
    lines = render(snapshot())  # r1 as a replica still loading (or an older server) reports it
    assert not [line for line in lines if line.startswith("replica ")]
