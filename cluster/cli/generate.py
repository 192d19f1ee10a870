"""`pdserve generate`: one generation, streamed from a running cluster over gRPC or, with
`--local`, from an engine in this process; printed as it comes, or as one JSON object
(`--json`: token ids, text, finish reason, usage, timing and, with `--logprobs`, per-token
logprobs)."""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

from cluster.cli.engine_flags import add_device_arguments
from cluster.config import ModelConfig
from cluster.request import TokenLogprobs


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "prompt", nargs="?", default=None, help="the prompt text (default: --prompt-token-ids)"
    )
    p.add_argument(
        "--prompt-token-ids",
        default=None,
        metavar="IDS",
        help="comma-separated token ids, instead of a prompt (default: the prompt)",
    )
    p.add_argument("--local", action="store_true", help="run the engine in this process")
    p.add_argument(
        "--target", default="127.0.0.1:9000", help="gRPC address of a cluster (not --local)"
    )
    p.add_argument(
        "--direct",
        action="store_true",
        help="call a router's own gRPC endpoint, listed by GetStats through --target, not "
        "Serve's proxy (default: the proxy; --target itself when none is listed)",
    )
    p.add_argument(
        "--direct-tls-ca",
        type=Path,
        default=None,
        metavar="PEM",
        help="with --direct: the endpoints serve TLS, signed by this CA (router.tls_cert_file; "
        "default: plaintext). The key, if the cluster wants one: $PDSERVE_API_KEY",
    )
    p.add_argument(
        "--application",
        default=None,
        help="Serve application, when Serve runs several (default: the only one)",
    )
    s = p.add_argument_group("sampling (unset: the server's defaults)")
    s.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens to generate at most (default: the server's, cut to fit the context)",
    )
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: 1.0)")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: 1.0)")
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument(
        "--seed", type=int, default=None, help="sampling seed (default: one per request)"
    )
    s.add_argument("--stop", action="append", default=[], help="a stop string; repeat for more")
    s.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence")
    s.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each token's logprob and the N most likely (default: none)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    local = p.add_argument_group("--local only")
    local.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or hub id (default: the embedded tiny model)",
    )
    add_device_arguments(local)


def generate_main(args: argparse.Namespace) -> int:
    ids = _token_ids(args)
    return _local(args, ids) if args.local else _remote(args, ids)


def _token_ids(args: argparse.Namespace) -> list[int] | None:
    if args.prompt_token_ids is None:
        if args.prompt is None:
            raise SystemExit("give a PROMPT or --prompt-token-ids")
        return None
    try:
        return [int(t) for t in args.prompt_token_ids.split(",") if t.strip()]
    except ValueError:
        raise SystemExit("--prompt-token-ids must be comma-separated integers") from None


def _remote(args: argparse.Namespace, token_ids: list[int] | None) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from cluster.client.generation_client import (
        FINISH_REASONS,
        GenerationClient,
        token_logprobs,
    )
    from cluster.pb.pdserve.v1 import generation_pb2 as pb

    sampling = pb.SamplingParams(top_k=args.top_k, stop=args.stop, ignore_eos=args.ignore_eos)
    for name in ("max_tokens", "temperature", "top_p", "seed", "logprobs"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    request = pb.GenerateRequest(sampling=sampling)
    if token_ids is not None:
        request.prompt_token_ids.extend(token_ids)
    else:
        request.prompt = args.prompt
    ids: list[int] = []
    text: list[str] = []
    scored: list[TokenLogprobs] = []
    last = None
    try:
        client = (
            GenerationClient.direct(args.target, args.application, tls_ca=_ca(args))
            if args.direct
            else GenerationClient(args.target, args.application)
        )
        with client:
            for msg in client.generate(request):
                ids.extend(msg.token_ids)
                text.append(msg.text)
                scored.extend(token_logprobs(msg))
                last = msg
                if not args.json:
                    print(msg.text, end="", flush=True)
    except grpc.RpcError as e:
        print(f"\nerror ({e.code().name}): {e.details()}", file=sys.stderr)
        return 2
    if not args.json:
        print()
        return 0
    result = {
        "request_id": last.request_id,
        "token_ids": ids,
        "text": "".join(text),
        "finish_reason": FINISH_REASONS.get(last.finish_reason, ""),
        "usage": MessageToDict(last.usage, preserving_proto_field_name=True),
        "timing": MessageToDict(last.timing, preserving_proto_field_name=True),
    }
    print(json.dumps({**result, **logprobs_json(ids, scored, args.logprobs)}))
    return 0


def _ca(args: argparse.Namespace) -> bytes | None:
    """The CA of `--direct-tls-ca`, read; None for plaintext."""
    if args.direct_tls_ca is None:
        return None
    try:
        return args.direct_tls_ca.read_bytes()
    except OSError as e:
        raise SystemExit(f"--direct-tls-ca {args.direct_tls_ca}: {e.strerror}") from None


def local_model(args: argparse.Namespace) -> ModelConfig:
    """`--local`'s model, its device and dtype decided as `pdserve serve` decides them."""
    from cluster.model.make_model import default_model_dir

    model = args.model or str(default_model_dir())
    return ModelConfig(model, dtype=args.dtype, device=args.device).on_device()


def _local(args: argparse.Namespace, ids: list[int] | None) -> int:
    from cluster.config import EngineConfig
    from cluster.engine.engine import Engine
    from cluster.request import Request, RequestOutput
    from cluster.sampling_params import SamplingParams

    engine = Engine(EngineConfig(local_model(args)))
    if ids is None:
        if engine.tokenizer is None:
            raise SystemExit("this checkpoint has no tokenizer: use --prompt-token-ids")
        ids = engine.tokenizer.encode(args.prompt, add_special_tokens=False)
    params = SamplingParams(
        max_tokens=args.max_tokens
        or engine.info.default_max_tokens(ids, engine.config.default_max_tokens),
        temperature=1.0 if args.temperature is None else args.temperature,
        top_p=1.0 if args.top_p is None else args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    request = Request(uuid.uuid4().hex, tuple(ids), params)
    engine.add_request(request)
    result = RequestOutput(request.request_id)
    while engine.has_work():
        for out in engine.step():
            result.add(out)
            if not args.json:
                print(out.text, end="", flush=True)
    if not args.json:
        print()
        return 0
    usage = {
        "prompt_tokens": len(ids),
        "completion_tokens": len(result.token_ids),
        "cached_prompt_tokens": result.num_cached_tokens,
    }
    summary = {
        "request_id": result.request_id,
        "token_ids": result.token_ids,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "usage": usage,
    }
    print(
        json.dumps({**summary, **logprobs_json(result.token_ids, result.logprobs, args.logprobs)})
    )
    return 0


def logprobs_json(token_ids: list[int], logprobs: list[TokenLogprobs], asked: int | None) -> dict:
    """`--json`'s "logprobs" entry (absent unless --logprobs was given): per token, its id,
    logprob and the most likely alternatives."""
    if asked is None:
        return {}
    return {
        "logprobs": [
            {
                "token_id": token,
                "logprob": lp.logprob,
                "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top],
            }
            for token, lp in zip(token_ids, logprobs, strict=True)
        ]
    }
