"""The Grafana dashboard is valid dashboard JSON and queries only metrics pdserve exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cluster.serving.metrics import METRICS

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve-dashboard.json"


def exported_series() -> set[str]:
    """Prometheus series names Ray gives pdserve's metrics (`ray_` prefix, type suffixes)."""
    names = set()
    for name, (kind, _, _) in METRICS.items():
        base = f"ray_{name}"
        if kind == "histogram":
            names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
        else:
            names.add(base)  # counters already end in _total
    return names


def test_dashboard_is_valid_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert {"id", "type", "title", "gridPos"} <= set(p)
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"][
            "w"
        ] <= 24
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert all(t["expr"] and t["refId"] for t in p["targets"])
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert any("Prefill" in r for r in rows) and any("Decode" in r for r in rows)
    assert any("Colocated" in r for r in rows)


def test_dashboard_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    used = {m for e in exprs for m in re.findall(r"\bray_[a-z_]+", e)}
    assert used, "the dashboard queries nothing"
    unknown = used - exported_series()
    assert not unknown, f"dashboard queries metrics pdserve does not export: {sorted(unknown)}"
    # Per pool: replicas over time, the scaling signal, latency percentiles, KV usage.
    for needed in (
        "ray_pdserve_replica_up",
        "ray_pdserve_queued_prompt_tokens",
        "ray_pdserve_running_sequences",
        "ray_pdserve_kv_cache_usage",
        "ray_pdserve_time_to_first_token_seconds_bucket",
        "ray_pdserve_inter_token_latency_seconds_bucket",
        "ray_pdserve_kv_transfer_bytes_total",
    ):
        assert needed in used, needed


def test_every_engine_pool_shows_its_replicas_load_latency_and_kv_usage():
    dash = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for pool in ("prefill", "decode", "colocated"):
        for metric in (
            "ray_pdserve_replica_up",
            "ray_pdserve_running_sequences" if pool != "prefill" else "ray_pdserve_queued_prompt",
            "ray_pdserve_kv_cache_usage",
            "ray_pdserve_queue_time_seconds" if pool != "decode" else "ray_pdserve_kv_transfer",
        ):
            assert re.search(rf'{metric}\w*{{[^}}]*pool="{pool}"', exprs), (pool, metric)
