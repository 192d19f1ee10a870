"""pdserve across hosts: five Ray nodes in network namespaces of their own (tests/multinode/
conftest.py), the production Serve config on the CPU. Each pool runs on its node type; greedy
outputs through Serve's proxy and the routers' direct endpoints equal transformers with the KV
moved between hosts over nixl and over grpc; nothing between nodes is bound to loopback; a
partition between the prefill and decode nodes and the loss of a whole prefill or decode node
cost no request, leave no KV block used or leased, and `GetStats` answers throughout."""

from __future__ import annotations

import json
import time

import pytest

from tests.multinode.conftest import FETCH_TIMEOUT_S, GRPC, NODE_TYPES, PD
from tests.multinode.namespaced_ray import node_resources

pytestmark = pytest.mark.slow
VOCAB = 4096  # the `tiny` preset's
ENGINES = {"Prefill": ["prefill", "prefill2"], "Decode": ["decode1", "decode2"], "Router": ["head"]}


def _cases(n: int, seed: int, max_tokens: int | None = None) -> list[tuple[list[int], int]]:
    return [
        (
            [(7 * i + 13 * j + seed) % (VOCAB - 50) + 50 for j in range(3 + (i * 5) % 60)],
            max_tokens or 4 + (i * 3) % 21,
        )
        for i in range(n)
    ]


def _replica_hosts(cluster, app: str) -> dict[str, str]:
    """Replica id -> host, for every RUNNING replica of `app`."""
    by_ip = {ip: host for host, ip in cluster.lab.hosts.items()}
    details = cluster.client("serve")[app]["deployments"]
    return {
        r["id"]: by_ip[r["ip"]] for rs in details.values() for r in rs if r["state"] == "RUNNING"
    }


def _check_greedy(results, cases, hf, model_dir) -> None:
    failed = [r.get("error") for r in results if "error" in r]
    assert not failed, failed
    for r, (ids, n) in zip(results, cases, strict=True):
        hf.assert_greedy(model_dir, ids, r["tokens"], n)
        assert r["finish_reason"] == "FINISH_REASON_LENGTH"


def _wait_for_idle(cluster, app: str, timeout: float = 60.0) -> dict:
    """GetStats until every engine replica reports no KV block used or leased and nothing
    running (after one report interval, so no answer from before the requests ended passes)."""
    deadline = time.monotonic() + timeout
    time.sleep(1.3)
    while True:
        stats = cluster.client("stats", app=app)
        engines = [r for r in stats["replicas"] if r["pool"] in ("prefill", "decode")]
        busy = [
            r
            for r in engines
            if r.get("kv_blocks_used") or r.get("kv_blocks_leased") or r.get("running")
        ]
        if engines and not busy:
            return stats
        assert time.monotonic() < deadline, f"KV not back to zero: {busy}"
        time.sleep(0.5)


def test_nodes_have_their_node_types_resources_and_each_pool_runs_only_on_its_own(cluster):
    nodes = {n["ip"]: n["resources"] for n in cluster.client("nodes") if n["state"] == "ALIVE"}
    for host, types in NODE_TYPES.items():
        got = nodes[cluster.lab.hosts[host]]
        for node_type in types:
            for resource, amount in node_resources(node_type).items():
                if resource != "CPU":
                    assert got.get(resource) == amount, (host, resource, got)
    details = cluster.client("serve")
    for app in (PD, GRPC):
        for deployment, hosts in ENGINES.items():
            replicas = details[app]["deployments"][deployment]
            assert replicas, (app, deployment)
            ips = {r["ip"] for r in replicas}
            assert ips <= {cluster.lab.hosts[h] for h in hosts}, (app, deployment, ips)
    decode_ips = {r["ip"] for r in details[PD]["deployments"]["Decode"]}
    assert decode_ips == {cluster.lab.hosts["decode1"], cluster.lab.hosts["decode2"]}


@pytest.mark.parametrize(("app", "transport"), [(PD, "nixl"), (GRPC, "grpc")])
def test_32_concurrent_greedy_requests_equal_transformers_with_kv_moved_between_hosts(
    cluster, app, transport, tokenizer_model_dir, hf
):
    stats = cluster.client("stats", app=app)
    assert stats["kv_transport"] == transport
    hosts = _replica_hosts(cluster, app)
    listed = {r["replica_id"] for r in stats["replicas"]}
    assert listed == set(hosts), (listed, hosts)  # every replica on every node, no other
    routers = [r for r in stats["replicas"] if r["pool"] == "router"]
    direct = [r["grpc_endpoint"] for r in routers]
    assert direct and all(e.rsplit(":", 1)[0] == cluster.head_ip for e in direct), direct
    for target, name in [(cluster.grpc_target, app), (direct[0], "")]:
        cases = _cases(32, seed=len(name))
        results = cluster.client("generate", target=target, app=name, cases=cases, timeout=240)
        _check_greedy(results, cases, hf, tokenizer_model_dir)
        for r in results:
            timing = r["timing"]
            assert hosts[timing["prefill_replica"]].startswith("prefill")
            assert hosts[timing["decode_replica"]].startswith("decode")
            assert timing["kv_transfer_seconds"] > 0
    _wait_for_idle(cluster, app)


def _ip(addr: str) -> str:
    """The IP of an `ss` address ("10.0.0.2:80", "[::ffff:10.0.0.2]:80", "*:80"), an IPv4-mapped
    IPv6 one written as IPv4: a socket of a dual-stack listener shows its peers that way."""
    ip = addr.rsplit(":", 1)[0].removeprefix("[").removesuffix("]")
    return ip.removeprefix("::ffff:")


def _listeners(cluster, host: str, pids: set[int]) -> list[str]:
    """IPs of the TCP sockets `pids` listen on in `host`."""
    out = cluster.lab.run(host, ["ss", "-Hltnp"]).stdout
    found = []
    for line in out.splitlines():
        if any(f"pid={pid}," in line for pid in pids):
            found.append(_ip(line.split()[3]))
    return found


def test_no_address_in_use_between_nodes_is_loopback(cluster):
    """The advertised endpoints (prefill KV servers, router direct endpoints) are on the node's
    address, and no replica listens on loopback only; the decode replicas' connections go to
    a prefill node (KV) and the head (token streams)."""
    for app in (PD, GRPC):
        stats = cluster.client("stats", app=app)
        hosts = _replica_hosts(cluster, app)
        for r in stats["replicas"]:
            for key in ("kv_endpoint", "grpc_endpoint"):
                if r.get(key):
                    want = cluster.lab.hosts[hosts[r["replica_id"]]]
                    assert r[key].rsplit(":", 1)[0] == want, r
    for host in NODE_TYPES:
        pids = set(cluster.lab.pids(host))
        bound = _listeners(cluster, host, pids)
        assert bound, host
        replica_pids = _replica_pids(cluster, host)
        for addr in _listeners(cluster, host, replica_pids):
            assert not addr.startswith("127.") and addr != "::1", (host, addr)
    # A decode replica holds its KV connection to a prefill replica only while a lease lives
    # (nixl drops a pair's connection at its last lease): look while requests run.
    load = cluster.client_popen("generate", app=GRPC, cases=_cases(24, seed=5), timeout=240)
    peers: set[str] = set()
    prefills = {cluster.lab.hosts[h] for h in ENGINES["Prefill"]}
    try:
        while load.poll() is None and not prefills & peers:
            for host in ("decode1", "decode2"):
                conns = cluster.lab.run(host, ["ss", "-Htn", "state", "established"]).stdout
                peers |= {_ip(line.split()[3]) for line in conns.splitlines()}
    finally:
        out, err = load.communicate(timeout=240)
    assert load.returncode == 0, err[-3000:]
    assert prefills & peers and cluster.head_ip in peers, peers
    _wait_for_idle(cluster, GRPC)


def _replica_pids(cluster, host: str) -> set[int]:
    """The Serve replica processes in `host` (their command line names ServeReplica)."""
    out = set()
    for pid in cluster.lab.pids(host):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"ServeReplica" in cmd:
            out.add(pid)
    return out


def test_a_partition_between_prefill_and_decode_nodes_never_hangs_a_request(
    cluster, tokenizer_model_dir, hf
):
    """While the prefill nodes and the decode nodes cannot reach each other (their bridge ports
    isolated; both still reach the head), fetches fail within fetch_timeout_seconds and the
    prompts are prefilled again; once the partition heals they go through. Every request ends
    exact or UNAVAILABLE, none hangs, and the KV comes back to zero."""
    cases = _cases(8, seed=3, max_tokens=12)
    partition_s = 6.0
    cluster.lab.isolate(["prefill", "prefill2", "decode1", "decode2"], on=True)
    try:
        client = cluster.client_popen("generate", app=PD, cases=cases, timeout=120)
        time.sleep(partition_s)
    finally:
        cluster.lab.isolate(["prefill", "prefill2", "decode1", "decode2"], on=False)
    out, err = client.communicate(timeout=180)
    assert client.returncode == 0, err[-3000:]
    results = json.loads(out.strip().splitlines()[-1])
    bound = 3 * (FETCH_TIMEOUT_S + 10)  # max_retries + 1 attempts, each a prefill and a fetch
    assert all(r["seconds"] < bound for r in results), [r["seconds"] for r in results]
    ok = [(r, c) for r, c in zip(results, cases, strict=True) if "error" not in r]
    assert all(r["error"][0] == "UNAVAILABLE" for r in results if "error" in r), results
    _check_greedy([r for r, _ in ok], [c for _, c in ok], hf, tokenizer_model_dir)
    # The fetches made during the partition failed: at least one request waited it out.
    assert max(r["seconds"] for r in results) >= FETCH_TIMEOUT_S, results
    _wait_for_idle(cluster, PD)


def _wait_for_pool(cluster, app: str, deployment: str, n: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        replicas = cluster.client("serve")[app]["deployments"][deployment]
        if sum(r["state"] == "RUNNING" for r in replicas) == n:
            return
        assert time.monotonic() < deadline, f"{deployment} not back to {n}: {replicas}"
        time.sleep(2.0)


def _kill_busiest_node_under_load(cluster, pool: str, cases, ready_after: int, watch_s: float):
    """Send `cases` to the PD app and, once the client says it is ready, kill every process of
    the node whose `pool` replica is busiest, while `GetStats` is polled every 0.5 s. Returns
    (the victim, the replica hosts, the results); the client must succeed and every poll of
    `GetStats` be OK."""
    hosts = _replica_hosts(cluster, PD)
    watch = cluster.client_popen("watch", app=PD, seconds=watch_s, interval=0.5)
    client = cluster.client_popen(
        "generate", app=PD, cases=cases, ready_after=ready_after, name_busiest=pool, timeout=240
    )
    try:
        ready, busiest = (client.stdout.readline().split() + ["", ""])[:2]
        assert ready == "READY" and busiest in hosts, (ready, busiest, client.stderr.read()[-3000:])
        victim = hosts[busiest]
        assert cluster.lab.kill_all(victim)
        out, err = client.communicate(timeout=300)
    finally:
        client.kill()
    assert client.returncode == 0, err[-3000:]
    w_out, w_err = watch.communicate(timeout=120)
    assert watch.returncode == 0, w_err[-3000:]
    seen = json.loads(w_out.strip().splitlines()[-1])
    assert seen and all(s["code"] == "OK" for s in seen), [s for s in seen if s["code"] != "OK"]
    return victim, hosts, json.loads(out.strip().splitlines()[-1])


def _rejoin_and_settle(cluster, victim: str, deployment: str) -> None:
    """Start `victim` again: both apps' `deployment` pools are back (2 and 1 replicas), no KV
    block is used or leased, and GetStats lists exactly the running replicas once the dead
    ones' entries have aged out."""
    cluster.start(victim)
    cluster.wait_for_nodes(list(NODE_TYPES))
    _wait_for_pool(cluster, PD, deployment, 2)
    _wait_for_pool(cluster, GRPC, deployment, 1)
    deadline = time.monotonic() + 60
    while True:  # the dead replicas' entries age out of the registry
        stats = _wait_for_idle(cluster, PD)
        listed = {r["replica_id"] for r in stats["replicas"]}
        if listed == set(_replica_hosts(cluster, PD)):
            break
        assert time.monotonic() < deadline, (listed, _replica_hosts(cluster, PD))
        time.sleep(2.0)
    _wait_for_idle(cluster, GRPC)


def test_a_decode_node_lost_mid_stream_costs_no_request_and_stats_keep_answering(
    cluster, tokenizer_model_dir, hf
):
    """Every process of a decode node (raylet, proxy, replicas) killed while 12 streams run,
    the node whose decode replica is running the most of them (Serve's choice once put none
    on the node a fixed choice killed): the streams it carried migrate, every request ends
    exact, `GetStats` answers OK all along; the node rejoins, the pool is back to two
    replicas, no KV block is used or leased, and GetStats lists exactly the running
    replicas."""
    cases = _cases(12, seed=5, max_tokens=400)
    _wait_for_pool(cluster, PD, "Decode", 2)
    victim, _, results = _kill_busiest_node_under_load(cluster, "decode", cases, 3, 45)
    _check_greedy(results, cases, hf, tokenizer_model_dir)
    assert sum(r["timing"].get("migrations", 0) for r in results) >= 1
    _rejoin_and_settle(cluster, victim, "Decode")


def test_a_prefill_node_lost_mid_load_costs_no_request_and_stats_keep_answering(
    cluster, tokenizer_model_dir, hf
):
    """Every process of a prefill node killed while 16 long prompts are prefilled, the node
    whose replica GetStats shows running or queueing the most of them: the prompts it held are
    prefilled again on the other node (KV it had leased, lost with it, too), every request ends
    exact, `GetStats` answers OK all along; the node rejoins, the pool is back to two replicas,
    no KV block is used or leased, and GetStats lists exactly the running replicas."""
    cases = [((ids * (900 // len(ids) + 1))[:900], 8) for ids, _ in _cases(16, seed=9)]
    _wait_for_pool(cluster, PD, "Prefill", 2)
    victim, hosts, results = _kill_busiest_node_under_load(cluster, "prefill", cases, 0, 30)
    _check_greedy(results, cases, hf, tokenizer_model_dir)
    by = [hosts.get(r["timing"]["prefill_replica"], "new") for r in results]
    print(f"\nprefill node {victim} lost; prefilled on:", {h: by.count(h) for h in set(by)})
    _rejoin_and_settle(cluster, victim, "Prefill")
