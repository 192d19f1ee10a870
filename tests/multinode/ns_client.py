"""What the multi-node tests ask of the cluster, run as a program inside the head host's network
namespace (`ip netns exec`), so the test process itself never opens a socket: it reads this
program's one JSON line on stdout.

    python -m tests.multinode.ns_client VERB JSON-ARGS

Verbs: `nodes` and `serve` (the dashboard's REST API: Ray's nodes, Serve's applications and
their replicas with each one's node), `stats` (`GetStats`), `generate` (many streaming
`Generate` calls at once; with `ready_after` it prints `READY` once every stream still going
has that many messages (0: at once), so the caller can break something under load, and with
`name_busiest` (a pool) also the id of that pool's replica then running the most of them, asked in
this process so no second program's start-up lets the streams end first), `watch` (`GetStats`
every `interval` s for `seconds` s, every answer's code and replicas). The dashboard calls
carry the cluster's Ray token (`RAY_AUTH_TOKEN`), as any client of a token-authenticated
cluster must.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc


def _rest(args: dict[str, Any], path: str) -> Any:
    request = urllib.request.Request(f"http://{args['dashboard']}{path}")
    request.add_header("Authorization", f"Bearer {os.environ['RAY_AUTH_TOKEN']}")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def nodes(args: dict[str, Any]) -> Any:
    listed = _rest(args, "/api/v0/nodes?limit=100&detail=true")["data"]["result"]["result"]
    return [
        {"ip": n["node_ip"], "state": n["state"], "resources": n["resources_total"]} for n in listed
    ]


def serve(args: dict[str, Any]) -> Any:
    apps = _rest(args, "/api/serve/applications/")["applications"]
    return {
        name: {
            "status": app["status"],
            "message": app.get("message", ""),
            "deployments": {
                d: [
                    {"id": r["replica_id"], "state": r["state"], "ip": r.get("node_ip", "")}
                    for r in info["replicas"]
                ]
                for d, info in app["deployments"].items()
            },
        }
        for name, app in apps.items()
    }


def _stub(target: str) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(target))


def stats(args: dict[str, Any]) -> Any:
    answer = _stub(args["target"]).GetStats(
        pb.GetStatsRequest(), metadata=(("application", args["app"]),), timeout=30
    )
    return MessageToDict(answer, preserving_proto_field_name=True)


def watch(args: dict[str, Any]) -> Any:
    s, seen = _stub(args["target"]), []
    end = time.monotonic() + args["seconds"]
    while time.monotonic() < end:
        began = time.monotonic()
        try:
            got = s.GetStats(
                pb.GetStatsRequest(), metadata=(("application", args["app"]),), timeout=10
            )
            seen.append({"code": "OK", "replicas": [[r.pool, r.replica_id] for r in got.replicas]})
        except grpc.RpcError as e:
            seen.append({"code": e.code().name, "details": e.details()})
        seen[-1]["seconds"] = time.monotonic() - began
        time.sleep(args["interval"])
    return seen


def _load(replica: dict[str, Any]) -> int:
    return int(replica.get("running", 0)) + int(replica.get("waiting", 0))


def _busiest(args: dict[str, Any]) -> list[str]:
    """[the id of the `name_busiest` pool's replica running or queueing the most sequences],
    when `name_busiest` asks for it; waits (up to 10 s) for a report that shows them."""
    pool = args.get("name_busiest")
    if not pool:
        return []
    deadline = time.monotonic() + 10.0
    while True:
        replicas = stats(args).get("replicas", [])
        engines = [r for r in replicas if r["pool"] == pool]
        busiest = max(engines, key=_load, default=None)
        if busiest is not None and _load(busiest) > 0:
            return [busiest["replica_id"]]
        if time.monotonic() > deadline:
            return ["none"]
        time.sleep(0.05)


def generate(args: dict[str, Any]) -> Any:
    """Every case (prompt ids, max tokens) as one greedy stream, all at once."""
    s = _stub(args["target"])
    metadata = (("application", args["app"]),) if args.get("app") else ()
    results: list[dict[str, Any]] = [{"tokens": [], "messages": 0} for _ in args["cases"]]

    def one(i: int, ids: list[int], n: int) -> None:
        out, began = results[i], time.monotonic()
        sampling = pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        request = pb.GenerateRequest(prompt_token_ids=ids, sampling=sampling)
        try:
            for msg in s.Generate(request, metadata=metadata, timeout=args.get("timeout", 120)):
                out["tokens"].extend(msg.token_ids)
                out["messages"] += 1
                if msg.finish_reason:
                    out["finish_reason"] = pb.FinishReason.Name(msg.finish_reason)
                    out["timing"] = MessageToDict(msg.timing, preserving_proto_field_name=True)
        except grpc.RpcError as e:
            out["error"] = [e.code().name, e.details()]
        out["seconds"] = time.monotonic() - began

    threads = [
        threading.Thread(target=one, args=(i, ids, n)) for i, (ids, n) in enumerate(args["cases"])
    ]
    for t in threads:
        t.start()
    ready_after = args.get("ready_after")
    if ready_after is not None:
        while not all(r["messages"] >= ready_after or "seconds" in r for r in results):
            time.sleep(0.005)
        print(" ".join(["READY", *_busiest(args)]), flush=True)
    for t in threads:
        t.join()
    return results


VERBS = {"nodes": nodes, "serve": serve, "stats": stats, "generate": generate, "watch": watch}

if __name__ == "__main__":
    verb, raw = sys.argv[1], sys.argv[2]
    print(json.dumps(VERBS[verb](json.loads(raw))), flush=True)
