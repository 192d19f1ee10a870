"""`pdserve serve`: start or join a Ray cluster, deploy the app, print where to reach it."""

from __future__ import annotations

import argparse
import signal
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from cluster.cli.auth_flags import add_auth_arguments, auth_fields
from cluster.cli.chat_flags import add_chat_arguments, chat_fields
from cluster.cli.engine_flags import (
    add_engine_arguments,
    check_model,
    engine_pool_fields,
    model_from_flags,
)
from cluster.errors import InvalidArgument
from cluster.serving.app import (
    BUILDER_PATH,
    GRPC_SERVICER,
    apply_node_env,
    build_app,
    config_from_args,
    default_config,
    override_conflicts,
)
from cluster.serving.app_config import AppConfig
from cluster.serving.autoscaling import DECODE_TARGETS, PREFILL_TARGETS, AutoscalingSettings
from cluster.serving.cpu_affinity import cpu_list_arg, format_cpu_list, reserve_for_engines
from cluster.serving.gpu_placement import ClusterView, place_gpus
from cluster.serving.placement import check_fits, check_tp_groups, local_cpus, wait_running


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument(
        "--mode",
        choices=["disaggregated", "colocated"],
        default="disaggregated",
        help="separate prefill and decode pools, or one pool doing both (the baseline)",
    )
    p.add_argument(
        "--prefill-replicas", type=int, default=1, help="prefill pool size (autoscaling: initial)"
    )
    p.add_argument(
        "--decode-replicas", type=int, default=1, help="decode pool size (autoscaling: initial)"
    )
    p.add_argument("--grpc-port", type=int, default=9000, help="Serve's gRPC proxy port")
    p.add_argument("--http-port", type=int, default=8000, help="Serve's HTTP proxy port")
    p.add_argument("--host", default="127.0.0.1", help="address the proxies bind")
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join: auto or ray://... (default: start a local Ray)",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="deploy a Serve config file, as `serve run FILE` does, instead of the flags that "
        "shape the app (default: the flags)",
    )
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per engine replica")
    p.add_argument(
        "--torch-threads", type=int, default=0, help="torch threads per engine; 0 = torch's"
    )
    p.add_argument(
        "--engine-cpus",
        type=cpu_list_arg,
        default=(),
        metavar="LIST",
        help="cores for the engine threads only, e.g. 1 or 2-7; the local Ray this starts runs "
        "on the other cores (with --address, start that cluster's Ray off them: taskset) "
        "(default: no pinning)",
    )
    p.add_argument(
        "--prefix-affinity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send a prompt back to the replica whose prefix cache holds its start; "
        "--no-prefix-affinity: Serve's power of two choices",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds for every replica to be placed and started; then pdserve serve ends, "
        "naming each pool short of replicas and what the cluster has",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="after a stream's first token, send tokens N to a message (the last may have "
        "fewer) unless a request says otherwise: fewer messages, less CPU per token, a "
        "burstier stream (vLLM's --stream-interval; default 1: each token at once)",
    )
    p.add_argument("--demo", action="store_true", help="send one request once it is up")
    p.add_argument("--exit", action="store_true", help="shut down after deploying (and --demo)")
    add_chat_arguments(p)
    add_auth_arguments(p)
    _add_autoscaling_arguments(p)


def _add_autoscaling_arguments(p: argparse.ArgumentParser) -> None:
    scale = p.add_argument_group("autoscaling (a pool autoscales once either bound is given)")
    for pool in ("prefill", "decode"):
        for bound in ("min", "max"):
            scale.add_argument(
                f"--{pool}-{bound}-replicas",
                type=int,
                default=None,
                help=f"{bound}imum {pool} replicas (default: no autoscaling)",
            )
    targets = dict(PREFILL_TARGETS + DECODE_TARGETS)
    scale.add_argument(
        "--prefill-target-queued-tokens",
        type=float,
        default=None,
        help=f"queued prompt tokens per prefill replica "
        f"(default: {targets['queued_prompt_tokens']:g})",
    )
    scale.add_argument(
        "--decode-target-running",
        type=float,
        default=None,
        help=f"running sequences per decode replica (default: {targets['running']:g})",
    )
    scale.add_argument(
        "--decode-target-kv-usage",
        type=float,
        default=None,
        help=f"KV cache usage (0-1) per decode replica (default: {targets['kv_usage']:g})",
    )
    scale.add_argument(
        "--upscale-delay", type=float, default=10.0, help="seconds a scale-up must hold"
    )
    scale.add_argument(
        "--downscale-delay", type=float, default=60.0, help="seconds a scale-down must hold"
    )


def serve_main(args: argparse.Namespace) -> int:
    # A bad config or model ends the command here, before Ray starts.
    apps = _file_apps(Path(args.config)) if args.config else _flag_app(args)
    configs = [c for c in apps.values() if c is not None]
    for config in configs if args.config else ():
        check_model(config.model, not args.address)
    _reserve_engine_cores(args)
    if not args.address:  # a joined cluster's nodes get NODE_ENV_VARS from `ray start`
        apply_node_env()
    import ray
    from ray import serve

    # A fresh local instance ("local": never one another process started) gets logical CPUs
    # for every replica asked for; a joined cluster keeps its own resources.
    context = ray.init(
        address=args.address or "local",
        num_cpus=None if args.address else local_cpus(configs),
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        ignore_reinit_error=True,
    )
    try:
        apps = place_apps(apps, ClusterView.current())
        configs = [c for c in apps.values() if c is not None]
        if not args.address:  # this Ray cannot grow: what does not fit never will
            check_fits(configs, ray.cluster_resources())
        grpc_port, http_port = _deploy(args, apps)
    except BaseException:
        if args.address:
            serve.shutdown()  # a joined cluster keeps running: take our apps off it
        else:
            # Our own local Ray goes with us: stop it at once. Serve's graceful shutdown waits
            # up to 30 s for replicas that never finished starting (the unplaced ones).
            ray.shutdown()
        raise
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    dashboard = getattr(context, "dashboard_url", None) or "(dashboard not running)"
    print(f"pdserve is up.\n  gRPC   {host}:{grpc_port}  (pdserve.v1.Generation)")
    print(f"  HTTP   http://{host}:{http_port}/v1  (OpenAI-compatible)")
    print(f"  Ray dashboard  http://{dashboard}  (Serve tab: per-pool replicas)")
    if args.demo:
        _demo(f"{host}:{grpc_port}", args.api_key[0] if args.api_key else None)
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


def _deploy(args: argparse.Namespace, apps: dict[str, AppConfig | None]) -> tuple[int, int]:
    """Deploy the config file or the flags' app; (gRPC, HTTP) ports once every app runs."""
    from ray import serve

    if args.config:
        return _deploy_config_file(Path(args.config), args.startup_timeout)
    (config,) = apps.values()
    serve.start(
        http_options={"host": args.host, "port": args.http_port},
        grpc_options={"port": args.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
    )
    target = serve.RunTarget(build_app(config), name=config.name, route_prefix="/")
    serve.run_many(
        [target], wait_for_ingress_deployment_creation=False, wait_for_applications_running=False
    )
    wait_running(apps, args.startup_timeout)
    return args.grpc_port, args.http_port


def _flag_app(args: argparse.Namespace) -> dict[str, AppConfig | None]:
    """The flags' app, its model checked (`check_model`) and a hub id pinned."""
    config = _config_from_flags(args)
    config = replace(config, model=check_model(config.model, not args.address))
    return {config.name: config}


def _file_apps(path: Path) -> dict[str, AppConfig | None]:
    """A config file's applications, checked (`read_serve_file`): name -> its `AppConfig`,
    None for one that is not pdserve's."""
    raw = read_serve_file(path)
    return {
        app.get("name", "default"): config_from_args(app.get("args"))
        if app.get("import_path") == BUILDER_PATH
        else None
        for app in raw.get("applications") or []
        if isinstance(app, dict)
    }


def place_apps(apps: dict[str, AppConfig | None], view: ClusterView) -> dict[str, AppConfig | None]:
    """Each pdserve app with its engine pools' GPUs decided from `view`, the nodes of the
    cluster just started or joined (`gpu_placement.place_gpus`), not from this machine: from a
    CPU-only head, engine pools with device auto ask for the GPUs of the engine nodes. A
    tensor-parallel replica no node of `view` can hold is refused (`check_tp_groups`)."""
    placed = {name: None if c is None else place_gpus(c, view) for name, c in apps.items()}
    check_tp_groups([c for c in placed.values() if c is not None], view)
    return placed


def _reserve_engine_cores(args: argparse.Namespace) -> None:
    engine_cpus = args.engine_cpus
    if engine_cpus and not args.address:
        # Before Ray starts: its processes inherit this mask, the engine threads leave it.
        rest = reserve_for_engines(engine_cpus)
        engines = (
            f"cores {format_cpu_list(engine_cpus)} kept for engines (the config file's pools "
            f"must name them in engine_cpus)"
            if args.config
            else f"engine threads on cores {format_cpu_list(engine_cpus)}"
        )
        print(f"{engines}; Ray, the proxies and the router on {format_cpu_list(rest)}")
    elif engine_cpus:
        print(
            f"engine threads on cores {format_cpu_list(engine_cpus)}; the joined cluster's Ray "
            "processes may still run there unless its nodes were started off them (taskset)"
        )


def _config_from_flags(args: argparse.Namespace) -> AppConfig:
    base = default_config(args.model)
    model = model_from_flags(args, base.model)
    pool = {  # num_gpus stays "auto": decided from the cluster's nodes (`place_apps`)
        "num_cpus": args.replica_cpus,
        "torch_threads": args.torch_threads,
        "engine_cpus": args.engine_cpus,
        "prefix_affinity": args.prefix_affinity,
    }
    return replace(
        base,
        model=model,
        mode=args.mode,
        stream_interval=args.stream_interval,
        **chat_fields(args),
        router=replace(base.router, **auth_fields(args)),
        prefill=replace(
            base.prefill,
            replicas=args.prefill_replicas,
            autoscaling=_autoscaling(args, "prefill", PREFILL_TARGETS),
            **pool,
            **engine_pool_fields(args, base.prefill, "prefill"),
        ),
        decode=replace(
            base.decode,
            replicas=args.decode_replicas,
            autoscaling=_autoscaling(args, "decode", DECODE_TARGETS),
            **pool,
            **engine_pool_fields(args, base.decode, "decode"),
        ),
    )


def _autoscaling(args: argparse.Namespace, pool: str, defaults) -> AutoscalingSettings | None:
    low = getattr(args, f"{pool}_min_replicas")
    high = getattr(args, f"{pool}_max_replicas")
    if low is None and high is None:
        return None
    fixed = getattr(args, f"{pool}_replicas")
    low = fixed if low is None else low
    high = max(low, fixed) if high is None else high
    overrides = {
        "queued_prompt_tokens": args.prefill_target_queued_tokens,
        "running": args.decode_target_running,
        "kv_usage": args.decode_target_kv_usage,
    }
    targets = tuple((s, overrides[s] or t) for s, t in defaults)
    return AutoscalingSettings(
        min_replicas=low,
        max_replicas=high,
        initial_replicas=min(max(fixed, low), high),
        upscale_delay_s=args.upscale_delay,
        downscale_delay_s=args.downscale_delay,
        targets=targets,
    )


def _deploy_config_file(path: Path, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Deploy a Serve config file the way `serve run FILE` does (ray/serve/scripts.py): start
    Serve with the file's proxy options, then hand the whole config to the Serve controller,
    which builds each application from its `import_path` and `args` and applies the file's
    `deployments:` overrides over what the code set. Ray has no public Python call for this
    last step. If Serve already runs, its proxies keep their options (Serve logs a warning).
    Like `serve deploy`, it deletes applications an earlier config file deployed that this one
    no longer lists. Blocks until every application is RUNNING (`wait_running`): on a cluster
    the autoscaler may first have to start GPU nodes, hence the long timeout."""
    from ray.serve._private.api import serve_start
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    raw = read_serve_file(path)
    config = ServeDeploySchema.model_validate(raw)
    client = serve_start(
        http_options=config.http_options.model_dump(),
        grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
        proxy_location=config.proxy_location,
        controller_options=config.controller_options,
    )
    client.deploy_apps(config)
    apps = {app.name: None for app in config.applications}
    wait_running({**apps, **{k: v for k, v in _file_apps(path).items() if k in apps}}, timeout_s)
    return config.grpc_options.port, config.http_options.port


def read_serve_file(path: Path) -> dict[str, Any]:
    """A Serve config file, each pdserve application in it checked as its builder will read
    it: `args` strictly (`AppConfig.from_dict`), and its `deployments:` entries against them
    (`override_conflicts`). Refused with INVALID_ARGUMENT naming the file, the application
    and each field."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InvalidArgument(f"{path}: {e}") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{path}: not a Serve config file (a mapping with applications:)")
    for app in raw.get("applications") or []:
        if not isinstance(app, dict) or app.get("import_path") != BUILDER_PATH:
            continue
        where = f"{path}: application {app.get('name', 'default')!r}"
        try:
            config = config_from_args(app.get("args"))
        except InvalidArgument as e:
            raise InvalidArgument(f"{where}, args: {e.message}", param=e.param) from None
        problems = override_conflicts(config, app.get("deployments") or [])
        if problems:
            raise InvalidArgument(f"{where}: " + "; ".join(problems))
    return raw


def _demo(target: str, api_key: str | None) -> None:
    from cluster.client.generation_client import GenerationClient
    from cluster.pb.pdserve.v1 import generation_pb2 as pb

    prompt = "pdserve splits prefill from decode"
    sampling = pb.SamplingParams(max_tokens=24, temperature=0.0)
    print(f"\ndemo request over gRPC: {prompt!r}")
    text, last = [], None
    with GenerationClient(target, api_key=api_key) as client:
        for msg in client.generate(pb.GenerateRequest(prompt=prompt, sampling=sampling)):
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
