"""Node-level autoscaling as `ray up` runs it: Ray's autoscaler with the fake multi-node
provider (tests/multinode/fake_autoscaling.py), node types shaped like deploy/aws/cluster.yaml
and pdserve's per-pool autoscaling. The decode pool may grow to two replicas and a
`decode_gpu` node holds exactly one, so under load its second replica fits on no node: the
autoscaler launches a `decode_gpu` node and the replica lands there. Once the load stops the
pool shrinks back to one replica and the autoscaler removes the idle node. Every request
succeeds with transformers' greedy output and the KV blocks come back to zero.

The head node type stands for cluster.yaml's head, router and prefill_gpu node types at once
(their pool resources added up, as tests/multinode/conftest.py's head host carries the
router's): two cores hold few Ray nodes. The Serve config is deploy/serve/production.yaml
changed for a CPU (tests/multinode/conftest.py `cpu_serve_config`), and further for one
machine: one proxy (every fake node has this machine's address, so a proxy per node would
fight over the ports), free ports, the grpc transport, and delays of seconds, not minutes.

    .venv/bin/pytest -m slow -s tests/multinode/test_node_autoscaling.py

prints the measured timeline (benchmarks/results/autoscaling.md has one run's).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from tests.multinode import ns_client
from tests.multinode.conftest import cpu_serve_config
from tests.multinode.fake_autoscaling import FakeAutoscalingRay, fake_provider_usable, free_port
from tests.multinode.test_multinode import _cases, _check_greedy

pytestmark = pytest.mark.slow
APP = "pdserve"
DECODE_TYPE = "decode_gpu"
HEAD_RESOURCES = {"CPU": 2, "router_pool": 1, "prefill_pool": 1}
# One decode replica ({CPU: 1, decode_pool: 1}) per node, min_workers / max_workers as in
# cluster.yaml's decode_gpu, fewer of them.
WORKER_TYPES = {
    DECODE_TYPE: {"resources": {"CPU": 1, "decode_pool": 1}, "min_workers": 1, "max_workers": 2}
}
IDLE_TIMEOUT_MINUTES = 0.1  # cluster.yaml: 10
DECODE_AUTOSCALING = {
    "min_replicas": 1,
    "initial_replicas": 1,
    "max_replicas": 2,
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 5.0,
    "look_back_period_s": 2.0,
    # 12 streams on one replica ask for ceil(12 / 4) = 3 replicas, capped at 2; idle, for 1.
    "targets": {"running": 4, "kv_usage": 0.75},
}
STREAMS = 12
T = TypeVar("T")
S = TypeVar("S", bound=Sized)


def serve_config(model_dir: Path, grpc_port: int) -> dict[str, Any]:
    raw = cpu_serve_config(model_dir)
    raw["applications"] = [app := raw["applications"][0]]
    raw["proxy_location"] = "HeadOnly"
    raw["http_options"] = {"host": "127.0.0.1", "port": free_port()}
    raw["grpc_options"]["port"] = grpc_port
    args = app["args"]
    args["transfer"]["transport"] = "grpc"
    for pool, cpus in (("router", 0.5), ("prefill", 1)):
        args[pool].pop("autoscaling", None)
        args[pool].update(replicas=1, num_cpus=cpus)
    args["decode"].update(num_cpus=1, autoscaling=DECODE_AUTOSCALING)
    return raw


def wait_for(what: str, probe: Callable[[], T], timeout: float, interval: float = 1.0) -> T:
    """`probe()` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = probe()
        except OSError:  # the dashboard is busy on a loaded machine: ask again
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(interval)


def exactly_one(probe: Callable[[], S]) -> Callable[[], S | None]:
    """A probe for `wait_for`: `probe()`'s answer once it holds exactly one item."""

    def one() -> S | None:
        got = probe()
        return got if len(got) == 1 else None

    return one


class Cluster:
    """The fake-autoscaling cluster with the app deployed, and what the test asks of it."""

    def __init__(self, ray: FakeAutoscalingRay, grpc_port: int):
        self.ray = ray
        self.args = {"target": f"127.0.0.1:{grpc_port}", "app": APP}

    def decode_replicas(self) -> dict[str, str]:
        """Running decode replica id -> its node id."""
        replicas = self.ray.replicas(APP, "Decode")
        return {r: node for r, (state, node) in replicas.items() if state == "RUNNING"}

    def stats(self) -> dict[str, Any]:
        return ns_client.stats(self.args)


@pytest.fixture(scope="module")
def fake_cluster(tokenizer_model_dir) -> Iterator[Cluster]:
    why_not = fake_provider_usable()
    if why_not:
        pytest.skip(f"node autoscaling needs Ray's fake multi-node provider: {why_not}")
    root = Path(tempfile.mkdtemp(prefix="pdfa-"))  # short: Ray's socket paths must fit
    ray = FakeAutoscalingRay(root, HEAD_RESOURCES, WORKER_TYPES, IDLE_TIMEOUT_MINUTES)
    began = time.monotonic()
    try:
        ray.start()
        wait_for("the min_workers decode node", lambda: ray.alive("decode_pool"), 180)
        grpc_port = free_port()
        config = root / "serve.yaml"
        config.write_text(yaml.safe_dump(serve_config(tokenizer_model_dir, grpc_port)))
        ray.deploy(config)
        wait_for("app RUNNING", lambda: ray.app_status(APP) == "RUNNING", 420, 3.0)
        print(f"\nfake autoscaling cluster up in {time.monotonic() - began:.0f} s")
        yield Cluster(ray, grpc_port)
    finally:
        try:
            ray.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)


class Load:
    """One client thread per case, each sending its case as a greedy stream (ns_client's
    `generate`) again and again until stopped: `len(cases)` streams in flight, steadily."""

    def __init__(self, cluster: Cluster, cases: list[tuple[list[int], int]]):
        self.args = {**cluster.args, "timeout": 240}
        self.done_pairs: list[tuple[dict[str, Any], tuple[list[int], int]]] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(c,)) for c in cases]

    def _run(self, case: tuple[list[int], int]) -> None:
        while not self.done.is_set():
            try:
                (result,) = ns_client.generate({**self.args, "cases": [case]})
            except Exception as e:  # noqa: BLE001 (a client that broke is a failed request)
                result = {"error": [type(e).__name__, str(e)]}
            self.done_pairs.append((result, case))
            if "error" in result:
                return

    @property
    def results(self) -> list[dict[str, Any]]:
        return [r for r, _ in self.done_pairs]

    @property
    def sent(self) -> list[tuple[list[int], int]]:
        return [c for _, c in self.done_pairs]

    def served_by(self, replica: str) -> int:
        return sum(r.get("timing", {}).get("decode_replica") == replica for r in self.results)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in self.threads), "the load did not finish"


class PoolWatch:
    """Every `interval` s, the decode pool as Serve and GetStats see it (replica states and
    nodes; target replicas and the running signal); each change printed and kept."""

    def __init__(self, cluster: Cluster, began: float, interval: float = 0.5):
        self.cluster, self.began, self.interval = cluster, began, interval
        self.changes: list[tuple[float, str]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _look(self) -> str:
        replicas = self.cluster.ray.replicas(APP, "Decode")
        pool = next(p for p in self.cluster.stats()["pools"] if p["pool"] == "decode")
        running = {s["name"]: s.get("value", 0) for s in pool.get("signals", [])}.get("running", 0)
        states = ", ".join(f"{r} {state} on {node[-5:]}" for r, (state, node) in replicas.items())
        nodes = ", ".join(sorted(n[-5:] for n in self.cluster.ray.alive("decode_pool")))
        target = pool.get("target_replicas", 0)
        return f"nodes [{nodes}]; target {target}, running {running:g}; {states}"

    def _run(self) -> None:
        last = ""
        while not self.done.wait(self.interval):
            try:
                now = self._look()
            except Exception as e:  # noqa: BLE001 (a busy dashboard: look again)
                now = f"not answered ({type(e).__name__}: {e})"
            if now != last:
                self.changes.append((time.monotonic() - self.began, now))
                print(f"{self.changes[-1][0]:7.1f} s    decode pool: {now}", flush=True)
                last = now

    def __enter__(self) -> PoolWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(timeout=60)


def wait_for_idle_kv(cluster: Cluster, timeout: float = 60.0) -> dict[str, Any]:
    """GetStats until every engine replica reports no KV block used or leased and nothing
    running (after one report interval, so no report from before the load ended passes)."""
    time.sleep(1.3)

    def idle() -> dict[str, Any] | None:
        stats = cluster.stats()
        engines = [r for r in stats["replicas"] if r["pool"] in ("prefill", "decode")]
        busy = [r for r in engines if r.get("kv_blocks_used") or r.get("kv_blocks_leased")]
        running = any(r.get("running") for r in engines)
        return stats if engines and not busy and not running else None

    return wait_for("KV back to zero", idle, timeout, 0.5)


def test_decode_grows_onto_a_node_the_autoscaler_launches_and_the_idle_node_goes(
    fake_cluster, tokenizer_model_dir, hf
):
    cluster = fake_cluster
    ray = cluster.ray
    (first_node,) = ray.alive("decode_pool")
    (first_replica,) = cluster.decode_replicas()
    assert cluster.decode_replicas()[first_replica] == first_node
    # Lengths apart, so the streams do not all end in the same step and leave the pool idle.
    cases = [(ids, 100 + 9 * i) for i, (ids, _) in enumerate(_cases(STREAMS, seed=11))]
    began = time.monotonic()

    def mark(event: str) -> None:
        print(f"{time.monotonic() - began:7.1f} s  {event}", flush=True)

    with PoolWatch(cluster, began):
        with Load(cluster, cases) as load:
            mark(f"load started: {STREAMS} streams")
            (new_node,) = wait_for(
                "a second decode node", lambda: ray.alive("decode_pool") - {first_node}, 240
            )
            mark(f"{DECODE_TYPE} node launched by the autoscaler ({new_node[-5:]})")
            (new_replica,) = wait_for(
                "a decode replica on the new node",
                lambda: [r for r, node in cluster.decode_replicas().items() if node == new_node],
                240,
            )
            mark(f"second decode replica RUNNING on it ({new_replica})")
            wait_for("the new replica serving", lambda: load.served_by(new_replica) >= STREAMS, 240)
            mark(f"new replica served {load.served_by(new_replica)} requests")
        mark(f"load stopped: {len(load.results)} requests")
        (kept_replica,) = wait_for(
            "decode back to one replica",
            exactly_one(cluster.decode_replicas),
            180,
        )
        mark("decode pool back to 1 replica")
        (kept_node,) = wait_for(
            "the idle decode node removed",
            exactly_one(lambda: ray.alive("decode_pool")),
            240,
        )
        (removed,) = {first_node, new_node} - {kept_node}
        mark(f"idle {DECODE_TYPE} node removed ({removed[-5:]})")

    assert kept_node == cluster.decode_replicas()[kept_replica]
    dead = {n["id"] for n in ray.nodes() if n["state"] == "DEAD"}
    assert removed in dead, (removed, dead)
    # The autoscaler saw the replica's resources as unmet demand, launched a node for it (the
    # min_workers node and this one) and removed the idle one.
    log = ray.autoscaler_log()
    assert re.search(r"\{[^}]*'decode_pool': 1\.0[^}]*\}: \d+\+ pending tasks/actors", log)
    assert len(re.findall(rf"Launching 1 nodes, type {DECODE_TYPE}\.", log)) == 2, log[-3000:]
    assert re.search(rf"Terminating the node with id {removed} and ip \S+\. \(idle\)", log)
    _check_greedy(load.results, load.sent, hf, tokenizer_model_dir)
    assert {r["timing"]["decode_replica"] for r in load.results} == {first_replica, new_replica}
    stats = wait_for_idle_kv(cluster)
    decodes = {r["replica_id"] for r in stats["replicas"] if r["pool"] == "decode"}
    assert kept_replica in decodes
    print(f"{len(load.results)} requests served, 0 failed", flush=True)
