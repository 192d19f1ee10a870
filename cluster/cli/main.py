"""The `pdserve` command line: make-model, generate, serve, status, bench, phases."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cluster.errors import PdServeError


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except PdServeError as e:
        print(f"error ({e.grpc_code}): {e.message}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    mk = sub.add_parser("make-model", help="write a deterministic random-weight checkpoint")
    mk.add_argument("out_dir")
    mk.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    mk.add_argument("--seed", type=int, default=0)
    mk.set_defaults(func=_make_model)

    gen = sub.add_parser("generate", help="generate from a prompt (in-process with --local)")
    gen.add_argument("prompt", nargs="?", default=None)
    gen.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids")
    gen.add_argument("--local", action="store_true", help="run the engine in this process")
    gen.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded tiny)")
    gen.add_argument("--target", default="127.0.0.1:9000", help="gRPC address of a cluster")
    gen.add_argument("--application", default=None, help="Serve application (if several)")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--logprobs", type=int, default=None, help="with --json: each token's logprob and N top"
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="float32")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="start (or join) a Ray cluster and deploy pdserve")
    from cluster.cli.serve import add_serve_arguments

    add_serve_arguments(srv)
    srv.set_defaults(func=_serve)

    st = sub.add_parser("status", help="pools, replicas and KV usage of a running cluster")
    st.add_argument("--target", default="127.0.0.1:9000")
    st.add_argument("--application", default=None, help="Serve application (if several)")
    st.set_defaults(func=_status)

    from cluster.cli import bench as bench_cli

    bn = sub.add_parser("bench", help="send a workload (trace or synthetic) and report latencies")
    bench_cli.add_arguments(bn)
    bn.set_defaults(func=bench_cli.bench_main)
    ph = sub.add_parser("phases", help="which phase dominates a workload, predicted and measured")
    bench_cli.add_arguments(ph, slo=False)
    ph.set_defaults(func=bench_cli.phases_main)
    return p


def _serve(args: argparse.Namespace) -> int:
    from cluster.cli.serve import serve_main

    return serve_main(args)


def _status(args: argparse.Namespace) -> int:
    from cluster.cli.status import status_main

    return status_main(args.target, args.application)


def _make_model(args: argparse.Namespace) -> int:
    from cluster.model.make_model import make_model

    path = make_model(args.preset, args.out_dir, seed=args.seed)
    print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from cluster.cli.generate import generate_main

    return generate_main(args)


if __name__ == "__main__":
    sys.exit(main())
