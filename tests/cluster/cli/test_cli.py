"""`pdserve make-model` and `pdserve generate --local` drive the real engine in-process."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.cli.generate import local_model
from cluster.cli.main import build_parser, main
from cluster.config import EngineConfig, ModelConfig
from cluster.engine.engine import Engine
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from cluster.serving.app import NODE_ENV_VARS, apply_node_env


def test_make_model_then_generate_local_json(tmp_path, capsys):
    out_dir = tmp_path / "tiny"
    assert main(["make-model", "--preset", "tiny", str(out_dir)]) == 0
    assert (out_dir / "config.json").is_file()
    capsys.readouterr()
    args = ["generate", "--local", "--model", str(out_dir), "--json", "--max-tokens", "5"]
    assert main([*args, "--temperature", "0", "--ignore-eos", "--prompt-token-ids", "9,8,7"]) == 0
    got = json.loads(capsys.readouterr().out)
    engine = Engine(EngineConfig(ModelConfig(str(out_dir))))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    (want,) = engine.generate([Request("r", (9, 8, 7), params)])
    assert got["token_ids"] == want.token_ids and got["text"] == want.text
    assert got["finish_reason"] == "length" and got["usage"]["prompt_tokens"] == 3
    assert "logprobs" not in got

    assert (
        main([*args, "--temperature", "0", "--prompt-token-ids", "9,8,7", "--logprobs", "2"]) == 0
    )
    scored = json.loads(capsys.readouterr().out)["logprobs"]
    assert [s["token_id"] for s in scored] == want.token_ids
    assert all(len(s["top_logprobs"]) == 2 for s in scored)
    assert all(s["top_logprobs"][0]["token_id"] == s["token_id"] for s in scored)  # greedy

    assert main(["generate", "--local", "--model", str(out_dir), "--max-tokens", "4", "Hi"]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_local_bad_input_is_a_clear_error(tmp_path, capsys):
    out_dir = tmp_path / "tiny"
    main(["make-model", str(out_dir)])
    capsys.readouterr()
    args = ["generate", "--local", "--model", str(out_dir), "--prompt-token-ids", "1,2"]
    assert main([*args, "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "temperature" in err


def test_generate_local_without_max_tokens_fits_the_default_to_the_context(tmp_path, capsys):
    """The default (256) is cut to what the context (2048) leaves after a long prompt."""
    out_dir = tmp_path / "tiny"
    main(["make-model", str(out_dir)])
    capsys.readouterr()
    ids = ",".join(str(50 + i % 4000) for i in range(2040))
    args = ["generate", "--local", "--model", str(out_dir), "--json", "--prompt-token-ids", ids]
    assert main([*args, "--temperature", "0", "--ignore-eos"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["usage"]["completion_tokens"] == 8 and got["finish_reason"] == "length"


def test_node_env_is_set_for_a_ray_started_here_unless_already_set(monkeypatch):
    assert NODE_ENV_VARS["RAY_SERVE_PROXY_USE_GRPC"] == "1"
    for key in NODE_ENV_VARS:
        monkeypatch.delenv(key, raising=False)
    assert apply_node_env() == NODE_ENV_VARS
    for key in NODE_ENV_VARS:
        monkeypatch.setenv(key, "0")  # the user's own choice wins
    assert apply_node_env() == dict.fromkeys(NODE_ENV_VARS, "0")


def test_serve_flag_turns_prefix_affinity_routing_off_for_the_prefilling_pools():
    import argparse

    from cluster.cli.serve import _config_from_flags, add_serve_arguments
    from cluster.serving.app import PREFIX_AFFINITY_ROUTER, build_app

    p = argparse.ArgumentParser()
    add_serve_arguments(p)

    def routers(flags: list[str]) -> dict[str, str]:
        """Deployment name -> its request router class, as `pdserve serve` would deploy it."""
        app = build_app(_config_from_flags(p.parse_args(flags)))
        pools = [a for a in app._bound_deployment.init_args if hasattr(a, "_bound_deployment")]
        deployments = [app._bound_deployment] + [a._bound_deployment for a in pools]
        return {
            d.name: d._deployment_config.request_router_config.request_router_class
            for d in deployments
        }

    on = routers(["--model", "/unused"])
    assert on["Prefill"] == PREFIX_AFFINITY_ROUTER
    assert on["Decode"] != PREFIX_AFFINITY_ROUTER and on["Router"] != PREFIX_AFFINITY_ROUTER
    assert on["Decode"] == on["Router"]  # Serve's default
    off = routers(["--model", "/unused", "--no-prefix-affinity"])
    assert off["Prefill"] == off["Decode"] == on["Decode"]
    colocated = routers(["--model", "/unused", "--mode", "colocated"])
    assert colocated["Colocated"] == PREFIX_AFFINITY_ROUTER


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--timeout", "0"], "--timeout must be > 0"),
    ],
)
@pytest.mark.parametrize("command", ["bench", "phases"])
def test_bench_and_phases_refuse_bad_limits_before_calling_anyone(command, args, message):
    with pytest.raises(SystemExit, match=message):
        main([command, "--target", "127.0.0.1:1", *args])


@pytest.mark.parametrize(
    ("cuda", "flags", "want"),
    [
        (True, [], ("cuda", "bfloat16")),
        (False, [], ("cpu", "float32")),
        (True, ["--dtype", "float16"], ("cuda", "float16")),
        (True, ["--device", "cpu"], ("cpu", "float32")),
    ],
)
def test_generate_local_decides_device_and_dtype_as_serve_does(monkeypatch, cuda, flags, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = build_parser().parse_args(["generate", "--local", "--model", "/m", *flags, "Hi"])
    model = local_model(args)
    assert (model.device, model.dtype) == want
    serve = build_parser().parse_args(["serve", "--model", "/m", *flags])
    assert (serve.device, serve.dtype) == (args.device, args.dtype)  # the same flags


def test_serves_chat_flags_reach_the_app_config(tmp_path):
    from cluster.cli.serve import _config_from_flags

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    flags = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    flags += ["--chat-template", str(template), "--default-chat-template-kwargs", '{"a": 1}']
    flags += ["--generation-config", "vllm"]
    args = build_parser().parse_args(
        ["serve", "--model", "/m", *flags, "--reasoning-parser", "qwen3"]
    )
    config = _config_from_flags(args)
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("hermes", True)
    assert config.reasoning_parser == "qwen3"
    assert config.chat_template == template.read_text()
    assert config.default_chat_template_kwargs == '{"a": 1}'
    assert config.generation_config == "vllm"
    plain = _config_from_flags(build_parser().parse_args(["serve", "--model", "/m"]))
    assert (plain.tool_call_parser, plain.enable_auto_tool_choice, plain.reasoning_parser) == (
        "",
        False,
        "",
    )
