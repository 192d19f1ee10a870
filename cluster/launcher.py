"""`pdserve serve`: start or join a Ray cluster, deploy the app, print where to reach it."""

from __future__ import annotations

import argparse
import signal
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve

from cluster.app import GRPC_SERVICER, build_app, default_config
from cluster.app_config import AppConfig


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded tiny)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    p.add_argument("--prefill-replicas", type=int, default=1)
    p.add_argument("--decode-replicas", type=int, default=1)
    p.add_argument("--grpc-port", type=int, default=9000)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="address the proxies bind")
    p.add_argument("--address", default=None, help="Ray cluster to join: auto or ray://...")
    p.add_argument("--config", default=None, help="a Serve config file, as for `serve run`")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per engine replica")
    p.add_argument("--torch-threads", type=int, default=0)
    p.add_argument("--demo", action="store_true", help="send one request once it is up")
    p.add_argument("--exit", action="store_true", help="shut down after deploying (and --demo)")


def serve_main(args: argparse.Namespace) -> int:
    context = ray.init(
        address=args.address,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        ignore_reinit_error=True,
    )
    if args.config:
        grpc_port, http_port = _deploy_config_file(Path(args.config))
    else:
        config = _config_from_flags(args)
        serve.start(
            http_options={"host": args.host, "port": args.http_port},
            grpc_options={"port": args.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
        )
        serve.run(build_app(config), name=config.name, route_prefix="/")
        grpc_port, http_port = args.grpc_port, args.http_port
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    dashboard = getattr(context, "dashboard_url", None) or "(dashboard not running)"
    print(f"pdserve is up.\n  gRPC   {host}:{grpc_port}  (pdserve.v1.Generation)")
    print(f"  HTTP   http://{host}:{http_port}/v1  (OpenAI-compatible)")
    print(f"  Ray dashboard  http://{dashboard}  (Serve tab: per-pool replicas)")
    if args.demo:
        _demo(f"{host}:{grpc_port}")
    if args.exit:
        serve.shutdown()
        return 0
    print("Ctrl-C to stop.")
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    return 0


def _config_from_flags(args: argparse.Namespace) -> AppConfig:
    base = default_config(args.model)
    model = replace(base.model, device=args.device, dtype=args.dtype)
    gpus = 1.0 if args.device.startswith("cuda") else 0.0
    pool = {"num_cpus": args.replica_cpus, "num_gpus": gpus, "torch_threads": args.torch_threads}
    return replace(
        base,
        model=model,
        mode=args.mode,
        prefill=replace(base.prefill, replicas=args.prefill_replicas, **pool),
        decode=replace(base.decode, replicas=args.decode_replicas, **pool),
    )


def _deploy_config_file(path: Path) -> tuple[int, int]:
    """Deploy every application of a Serve config file, with its proxy options."""
    from ray.serve.schema import ServeDeploySchema

    raw: dict[str, Any] = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    grpc_opts = raw.get("grpc_options") or {}
    http_opts = raw.get("http_options") or {}
    serve.start(http_options=http_opts, grpc_options=grpc_opts)
    for app in schema.applications:
        module, _, attr = app.import_path.replace(":", ".").rpartition(".")
        builder = getattr(__import__(module, fromlist=[attr]), attr)
        serve.run(builder(app.args or {}), name=app.name, route_prefix=app.route_prefix)
    return int(grpc_opts.get("port", 9000)), int(http_opts.get("port", 8000))


def _demo(target: str) -> None:
    from cluster.grpc_client import connect
    from cluster.pb.pdserve.v1 import generation_pb2 as pb

    prompt = "pdserve splits prefill from decode"
    sampling = pb.SamplingParams(max_tokens=24, temperature=0.0)
    print(f"\ndemo request over gRPC: {prompt!r}")
    text, last = [], None
    for msg in connect(target).Generate(pb.GenerateRequest(prompt=prompt, sampling=sampling)):
        text.append(msg.text)
        last = msg
    t = last.timing
    print(f"  -> {''.join(text)!r}")
    print(
        f"  {last.usage.completion_tokens} tokens;"
        f" TTFT {t.time_to_first_token_seconds * 1e3:.1f} ms"
        f" (prefill {t.prefill_seconds * 1e3:.1f} ms on {t.prefill_replica},"
        f" KV transfer {t.kv_transfer_seconds * 1e3:.1f} ms),"
        f" decode {t.decode_seconds * 1e3:.1f} ms on {t.decode_replica}\n"
    )
