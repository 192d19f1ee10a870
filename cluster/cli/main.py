"""The `pdserve` command line: make-model, generate, serve, status, bench, phases, profile,
plan, config-schema."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from cluster.cli.version import package_version
from cluster.errors import PdServeError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default: "(default: X)" is added unless the help
    already says what the default is, as it must where the default is None."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except PdServeError as e:
        print(f"error ({e.grpc_code}): {e.message}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    def verb(name: str, text: str, func) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        parser.set_defaults(func=func)
        return parser

    mk = verb("make-model", "write a deterministic random-weight checkpoint", _make_model)
    mk.add_argument("out_dir", help="directory to write the checkpoint and tokenizer into")
    mk.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="model shape")
    mk.add_argument("--seed", type=int, default=0, help="seed of the random weights")

    from cluster.cli import bench as bench_cli
    from cluster.cli.generate import add_generate_arguments
    from cluster.cli.serve import add_serve_arguments
    from cluster.cli.status import add_status_arguments

    gen = verb("generate", "generate from a prompt (in-process with --local)", _generate)
    add_generate_arguments(gen)
    srv = verb("serve", "start (or join) a Ray cluster and deploy pdserve", _serve)
    add_serve_arguments(srv)
    st = verb("status", "pools, replicas and KV usage of a running cluster", _status)
    add_status_arguments(st)
    bn = verb("bench", "send a workload (trace or synthetic) and report latencies", None)
    bench_cli.add_arguments(bn)
    bn.set_defaults(func=bench_cli.bench_main)
    ph = verb("phases", "which phase dominates a workload, predicted and measured", None)
    bench_cli.add_arguments(ph, slo=False)
    ph.set_defaults(func=bench_cli.phases_main)
    from cluster.cli import planner as planner_cli

    pf = verb("profile", "fit step-time models from probes of a running deployment", None)
    planner_cli.add_profile_arguments(pf)
    pf.set_defaults(func=planner_cli.profile_main)
    pl = verb("plan", "simulate P:D splits and colocation on a workload, pick the best", None)
    planner_cli.add_plan_arguments(pl)
    pl.set_defaults(func=planner_cli.plan_main)
    verb(
        "config-schema",
        "print the JSON schema of the app config (a Serve config's `args`)",
        _config_schema,
    )
    return p


def _serve(args: argparse.Namespace) -> int:
    from cluster.cli.serve import serve_main

    return serve_main(args)


def _status(args: argparse.Namespace) -> int:
    from cluster.cli.status import status_main

    return status_main(args)


def _make_model(args: argparse.Namespace) -> int:
    from cluster.model.make_model import make_model

    path = make_model(args.preset, args.out_dir, seed=args.seed)
    print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from cluster.cli.generate import generate_main

    return generate_main(args)


def _config_schema(args: argparse.Namespace) -> int:
    from cluster.serving.app_config import app_config_schema

    print(json.dumps(app_config_schema(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
