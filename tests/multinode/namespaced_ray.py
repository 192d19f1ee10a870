"""`NamespacedRay`: a Ray cluster whose nodes are hosts of a `NetnsLab`, started the way
`ray up` starts deploy/aws/cluster.yaml's nodes: `ray start --head` on the head host, `ray
start --address HEAD:6379` on the others, each with the resources of its node type in that
file (the GPUs left out: the engines run on the CPU here), every port on the node's own
address (`--node-ip-address`; the dashboard on all interfaces, as the file starts it).

Every node runs with token authentication (`RAY_AUTH_MODE=token`, one `RAY_AUTH_TOKEN` for the
cluster and every client), `RAY_SERVE_PROXY_USE_GRPC=1` (cluster/serving/app.py
NODE_ENV_VARS), and UCX on TCP over `eth0`: the namespaces share one kernel, so UCX would
otherwise see one host and move NIXL's bytes through shared memory, not the network.

Each node keeps its Ray files under a temp dir of its own; `ray stop` is never used (it would
stop every Ray on the machine): a node goes with every process of its host
(`NetnsLab.kill_all`).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from cluster.serving.app import NODE_ENV_VARS
from tests.multinode.netns_lab import NetnsLab

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "deploy" / "aws" / "cluster.yaml"
GCS_PORT, DASHBOARD_PORT, GRPC_PORT = 6379, 8265, 9000
OBJECT_STORE_BYTES = 256 << 20  # Ray's default is 30% of the machine's memory, per node


def node_resources(node_type: str) -> dict[str, float]:
    """`node_type`'s resources in deploy/aws/cluster.yaml, without GPUs."""
    types = yaml.safe_load(CLUSTER_YAML.read_text())["available_node_types"]
    return {k: v for k, v in types[node_type]["resources"].items() if k != "GPU"}


class NamespacedRay:
    def __init__(self, lab: NetnsLab, temp_root: Path, node_types: dict[str, list[str]]):
        """`node_types`: host -> the cluster.yaml node types it stands for (their resources
        added up); the first host is the head."""
        self.lab = lab
        self.temp_root = temp_root
        self.node_types = node_types
        self.head = next(iter(node_types))
        self.env = {
            **NODE_ENV_VARS,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": "eth0",
            "PYTHONPATH": str(REPO),
            "RAY_USAGE_STATS_ENABLED": "0",
        }

    @property
    def head_ip(self) -> str:
        return self.lab.hosts[self.head]

    @property
    def grpc_target(self) -> str:
        return f"{self.head_ip}:{GRPC_PORT}"

    @property
    def dashboard(self) -> str:
        return f"{self.head_ip}:{DASHBOARD_PORT}"

    def start_command(self, host: str) -> list[str]:
        resources: dict[str, float] = {}
        for node_type in self.node_types[host]:
            for k, v in node_resources(node_type).items():
                resources[k] = resources.get(k, 0) + v
        command = [
            str(Path(sys.executable).with_name("ray")), "start",
            f"--node-ip-address={self.lab.hosts[host]}",
            f"--num-cpus={int(resources.pop('CPU', 0))}", "--num-gpus=0",
            f"--resources={json.dumps(resources)}",
            f"--temp-dir={self.temp_root / host}", "--disable-usage-stats",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
        ]  # fmt: skip
        if host == self.head:
            return [
                *command, "--head", f"--port={GCS_PORT}", "--include-dashboard=true",
                "--dashboard-host=0.0.0.0", f"--dashboard-port={DASHBOARD_PORT}",
            ]  # fmt: skip
        return [*command, f"--address={self.head_ip}:{GCS_PORT}"]

    def start(self, host: str, attempts: int = 2) -> None:
        """`ray start` on `host`; on a loaded machine its wait for the GCS can run out, so a
        failed start is cleared (every process of the host killed) and tried again."""
        for _ in range(attempts):
            done = self.lab.run(host, self.start_command(host), env=self.env, timeout=240)
            if done.returncode == 0:
                return
            self.lab.kill_all(host)
        raise AssertionError(f"ray start on {host}: {done.stdout}\n{done.stderr}")

    def client(self, verb: str, timeout: float = 120.0, **args: Any) -> Any:
        """`tests.multinode.ns_client VERB` in the head host; its JSON answer."""
        args = {"dashboard": self.dashboard, "target": self.grpc_target, **args}
        done = self.lab.run(
            self.head,
            [sys.executable, "-m", "tests.multinode.ns_client", verb, json.dumps(args)],
            env=self.env,
            timeout=timeout,
            cwd=REPO,
        )
        assert done.returncode == 0, f"ns_client {verb}: {done.stderr[-3000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    def client_popen(self, verb: str, **args: Any) -> subprocess.Popen:
        args = {"dashboard": self.dashboard, "target": self.grpc_target, **args}
        return self.lab.popen(
            self.head,
            [sys.executable, "-m", "tests.multinode.ns_client", verb, json.dumps(args)],
            env=self.env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def alive_nodes(self) -> set[str]:
        return {n["ip"] for n in self.client("nodes") if n["state"] == "ALIVE"}

    def wait_for_nodes(self, hosts: list[str], timeout: float = 180.0) -> None:
        want = {self.lab.hosts[h] for h in hosts}
        deadline = time.monotonic() + timeout
        while not want <= (alive := self.alive_nodes()):
            assert time.monotonic() < deadline, f"nodes alive: {alive}, want {want}"
            time.sleep(2.0)

    def deploy(self, config_file: Path) -> None:
        """`serve deploy FILE` against the head's dashboard, from the head host."""
        serve_cli = str(Path(sys.executable).with_name("serve"))
        done = self.lab.run(
            self.head,
            [serve_cli, "deploy", str(config_file), "--address", f"http://{self.dashboard}"],
            env=self.env,
            timeout=180,
            cwd=REPO,
        )
        assert done.returncode == 0, f"serve deploy: {done.stdout}\n{done.stderr}"

    def wait_until_running(self, apps: list[str], timeout: float = 420.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                details = self.client("serve")
            except AssertionError:  # the dashboard's Serve module is not up yet
                details = {}
            if all(details.get(a, {}).get("status") == "RUNNING" for a in apps):
                return details
            assert time.monotonic() < deadline, f"not RUNNING after {timeout}s: {details}"
            time.sleep(3.0)
