"""`FakeAutoscalingRay`: a Ray cluster on this machine whose worker nodes are launched and
removed by Ray's own autoscaler, as `ray up` runs it, through Ray's fake multi-node provider
(`ray.autoscaler._private.fake_multi_node`): each "node" it launches is a raylet of its own,
with the resources of its node type, on this machine.

The cluster config has deploy/aws/cluster.yaml's shape: the head plus worker node types that
provide the pools' custom resources (`router_pool`, `prefill_pool`, `decode_pool`), each with
min_workers, max_workers and the cluster's idle_timeout_minutes. The head is started the way
the provider expects (`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...`); the
head node type is therefore called `ray.head.default`, the name the provider tags its head
with. The provider is named by module (`type: external`): the wheel lacks the example.yaml
that `type: fake_multinode` reads its defaults from.

This machine is shared, so the cluster keeps to itself: its own temp dir and free ports for
every server (GCS, dashboard, agents, Ray client), token authentication with a token of its
own (`RAY_AUTH_MODE=token`, `RAY_AUTH_TOKEN`: ~/.ray/auth_token is someone else's), and
`ray stop` is never run (it would stop every Ray on the machine). Every process of the
cluster inherits `MARKER`=<this cluster's id> from the head's environment (the autoscaler
starts the worker nodes from its own process), and `stop` ends exactly the processes that
carry it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import ray._private.services

from cluster.serving.app import NODE_ENV_VARS
from tests.multinode.namespaced_ray import REPO

MARKER = "PDSERVE_FAKE_CLUSTER_ID"
HEAD_TYPE = "ray.head.default"  # the fake provider's name for the head's node type
OBJECT_STORE_BYTES = 256 << 20  # Ray's default is 30% of the machine's memory, per node
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_provider_usable() -> str:
    """Why the fake multi-node provider cannot run here, or "" if it can."""
    try:
        from ray.autoscaler._private.fake_multi_node.node_provider import (  # noqa: F401
            FakeMultiNodeProvider,
        )
    except ImportError as e:
        return f"this Ray wheel has no fake multi-node provider ({e})"
    if not (BIN / "ray").exists() or not (BIN / "serve").exists():
        return f"no ray / serve command beside {sys.executable}"
    return ""


class FakeAutoscalingRay:
    def __init__(
        self,
        root: Path,
        head_resources: dict[str, float],
        worker_types: dict[str, dict[str, Any]],
        idle_timeout_minutes: float,
    ):
        """`worker_types`: node type -> {resources, min_workers, max_workers}, as in a
        cluster.yaml's available_node_types."""
        self.root = root
        self.head_resources = head_resources
        self.worker_types = worker_types
        self.idle_timeout_minutes = idle_timeout_minutes
        self.id = secrets.token_hex(8)
        self.ip = ray._private.services.get_node_ip_address()
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        # Nothing of another Ray this process may know of (RAY_ADDRESS, another token).
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env = {
            **inherited,
            **NODE_ENV_VARS,
            MARKER: self.id,
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Replicas report load every second, so the pools scale within a test's time.
            "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
            "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
            "PYTHONPATH": str(REPO),
        }

    @property
    def dashboard(self) -> str:
        return f"127.0.0.1:{self.dashboard_port}"

    def cluster_config(self) -> dict[str, Any]:
        """The autoscaler's cluster config: what `ray up` hands the head as
        ~/ray_bootstrap_config.yaml, with the fake provider in place of AWS."""
        types: dict[str, Any] = {
            HEAD_TYPE: {"resources": self.head_resources, "node_config": {}, "max_workers": 0}
        }
        for name, t in self.worker_types.items():
            types[name] = {
                "resources": {**t["resources"], "object_store_memory": OBJECT_STORE_BYTES},
                "node_config": {},
                "min_workers": t["min_workers"],
                "max_workers": t["max_workers"],
            }
        return {
            "cluster_name": f"pdserve-fake-{self.id}",
            "max_workers": sum(t["max_workers"] for t in self.worker_types.values()),
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": self.idle_timeout_minutes,
            "provider": {
                "type": "external",
                "module": "ray.autoscaler._private.fake_multi_node.node_provider."
                "FakeMultiNodeProvider",
                "gcs_address": f"{self.ip}:{self.gcs_port}",
                # Every fake node has this machine's IP: the autoscaler tells them apart by id.
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
            },
            "auth": {"ssh_user": "ubuntu"},
            "available_node_types": types,
            "head_node_type": HEAD_TYPE,
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
        }

    def start_command(self, config_file: Path) -> list[str]:
        resources = dict(self.head_resources)
        return [
            str(BIN / "ray"), "start", "--head",
            f"--port={self.gcs_port}", f"--autoscaling-config={config_file}",
            f"--num-cpus={int(resources.pop('CPU', 0))}", "--num-gpus=0",
            f"--resources={json.dumps(resources)}",
            f"--temp-dir={self.root / 'ray'}", "--disable-usage-stats",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        ]  # fmt: skip

    def start(self) -> None:
        config_file = self.root / "cluster.json"
        config_file.write_text(json.dumps(self.cluster_config(), indent=1))
        done = subprocess.run(
            self.start_command(config_file), env=self.env, capture_output=True, text=True,
            timeout=240, start_new_session=True,
        )  # fmt: skip
        assert done.returncode == 0, f"ray start --head: {done.stdout}\n{done.stderr}"

    def pids(self) -> list[int]:
        """Every process that carries this cluster's marker."""
        needle = f"{MARKER}={self.id}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:  # gone, or not ours
                continue
            if needle in environ.split(b"\0"):
                found.append(int(entry.name))
        return found

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to every process of the cluster, SIGKILL to what is left after `grace_s`."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        assert not self.pids(), f"processes of the fake cluster left: {self.pids()}"

    def rest(self, path: str) -> Any:
        """The dashboard's REST API, with the cluster's token."""
        request = urllib.request.Request(f"http://{self.dashboard}{path}")
        request.add_header("Authorization", f"Bearer {self.env['RAY_AUTH_TOKEN']}")
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())

    def nodes(self) -> list[dict[str, Any]]:
        """Every node the GCS knows, alive or dead: id, state, total resources."""
        listed = self.rest("/api/v0/nodes?limit=100&detail=true")["data"]["result"]["result"]
        return [
            {"id": n["node_id"], "state": n["state"], "resources": n["resources_total"]}
            for n in listed
        ]

    def alive(self, resource: str) -> set[str]:
        """Ids of the alive nodes that provide `resource`."""
        return {
            n["id"] for n in self.nodes() if n["state"] == "ALIVE" and resource in n["resources"]
        }

    def replicas(self, app: str, deployment: str) -> dict[str, tuple[str, str]]:
        """Replica id -> (state, node id), for `deployment` of `app`."""
        apps = self.rest("/api/serve/applications/")["applications"]
        listed = apps.get(app, {}).get("deployments", {}).get(deployment, {}).get("replicas", [])
        return {r["replica_id"]: (r["state"], r.get("node_id", "")) for r in listed}

    def app_status(self, app: str) -> str:
        try:
            apps = self.rest("/api/serve/applications/")["applications"]
        except OSError:  # the dashboard's Serve module is not up yet
            return ""
        return apps.get(app, {}).get("status", "")

    def deploy(self, config_file: Path) -> None:
        """`serve deploy FILE` against the cluster's dashboard; retried while the dashboard
        comes up, as cluster.yaml's head_start_ray_commands do."""
        for _ in range(30):
            done = subprocess.run(
                [str(BIN / "serve"), "deploy", str(config_file), "--address",
                 f"http://{self.dashboard}"],
                env=self.env, capture_output=True, text=True, timeout=180, cwd=REPO,
            )  # fmt: skip
            if done.returncode == 0:
                return
            time.sleep(2.0)
        raise AssertionError(f"serve deploy: {done.stdout}\n{done.stderr}")

    def autoscaler_log(self) -> str:
        """The autoscaler's log (the session's monitor.log)."""
        log = self.root / "ray" / "session_latest" / "logs" / "monitor.log"
        return log.read_text(errors="replace")
